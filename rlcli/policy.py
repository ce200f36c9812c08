"""The Megatron side of the step: the trainable actor and the frozen reference policy.

Both are megatron-core GPT models sharded over (TP, PP) and replicated over DP, built from a HF
model directory. Everything here works on the collated batch layout of ``rlcli.batch``; results
come back response-aligned, ``[B, R]``, on every rank of the model-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parallel.mesh import Mesh
from parallel.micro_batches import micro_batches
from parallel.offload import Offloader, TransferStats
from parallel.schedule import LossFn, forward_log_probs
from rlcli.batch import response_values
from rlcli.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class OptimizerSettings:
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    warmup_steps: int
    total_steps: int
    decay_style: str
    use_distributed_optimizer: bool


class MegatronPolicy:
    """Model chunks of this rank (+ optimizer when trainable)."""

    def __init__(
        self,
        mesh: Mesh,
        hf_dir: str,
        dtype: str = "float32",
        optim: OptimizerSettings | None = None,
        model_options: dict[str, Any] | None = None,
        critic: bool = False,
    ) -> None:
        """``model_options``: ``parallel.model.build_model``'s layout options (sequence_parallel,
        transformer_impl, attention_backend, recompute, pack_sequences: every forward of this
        model then runs packed micro-batches); a setting this machine cannot build is a
        UserError. ``critic``: a value-head model (``rlcli.critic.MegatronCritic``) instead of
        an LM."""
        from parallel.hf_model import load_hf_model
        from parallel.model_backends import ModelConfigError

        self.mesh = mesh
        self.pack_sequences = bool((model_options or {}).get("pack_sequences", False))
        try:
            models = load_hf_model(
                hf_dir, mesh, dtype=DTYPES[dtype], critic=critic, **(model_options or {})
            )
        except ModelConfigError as err:
            raise UserError(str(err)) from None
        self.hf_config = models[0].hf_config
        self.optimizer = self.scheduler = None
        if optim is None:
            for model in models:
                model.eval()
                model.requires_grad_(False)
        else:
            from parallel.optim import build_optimizer, wrap_for_training

            models = wrap_for_training(
                models, mesh, use_distributed_optimizer=optim.use_distributed_optimizer
            )
            self.optimizer, self.scheduler = build_optimizer(
                models,
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad,
                use_distributed_optimizer=optim.use_distributed_optimizer,
                warmup_steps=optim.warmup_steps,
                total_steps=max(1, optim.total_steps),
                decay_style=optim.decay_style,
            )
        self.models = models
        self.offloader = Offloader(models, self.optimizer)
        # The RL trainer steps the LR schedule once per RL step (``advance_schedule``) and sets
        # this False; SFT keeps one schedule step per optimizer step.
        self.schedule_per_update = True
        self.nonfinite_updates = 0  # optimizer steps dropped for a non-finite loss or gradient

    @torch.no_grad()
    def log_probs(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        temperature: float = 1.0,
        max_tokens: int = 0,
    ) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the response tokens under the current weights; ``max_tokens``
        > 0 cuts the forward micro-batches by a token budget (``parallel.micro_batches``)."""
        per_position = forward_log_probs(
            self.models,
            self.mesh,
            batch["input_ids"],
            batch["attention_mask"],
            micro_batch_size,
            temperature,
            max_tokens=max_tokens,
            pack_sequences=self.pack_sequences,
        )
        return response_values(per_position.cpu(), batch["response_index"])

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        loss_fn: LossFn,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        max_tokens: int = 0,
    ) -> dict[str, Any]:
        """One optimizer step over ``batch`` cut into micro-batches (gradients summed over
        micro-batches, averaged over DP): ``micro_batch_size`` rows each, or by a token budget
        when ``max_tokens`` > 0 (``parallel.micro_batches``)."""
        from parallel.optim import train_step

        result = train_step(
            self.models,
            self.mesh,
            self.optimizer,
            self.scheduler,
            micro_batches(
                batch,
                micro_batch_size,
                equal_sizes=self.mesh.pp > 1,
                max_tokens=max_tokens,
                pack=self.pack_sequences,
            ),
            loss_fn,
            temperature=temperature,
            compute_entropy=compute_entropy,
            step_scheduler=self.schedule_per_update,
            pack_sequences=self.pack_sequences,
        )
        self.nonfinite_updates += bool(result.get("nonfinite"))
        return result

    def advance_schedule(self) -> None:
        """One step of the LR / weight-decay schedule (the RL trainer: once per RL step)."""
        if self.scheduler is not None:
            self.scheduler.step(increment=1)

    def offload(
        self, *, params: bool = False, grads: bool = False, optimizer: bool = False
    ) -> TransferStats:
        """Free the chosen device memory between phases (pinned host copies on GPU; gradients are
        discarded, the next update zeroes them anyway). ``onload`` before the next use."""
        return self.offloader.offload(
            params=params, grads=grads, optimizer=optimizer, discard_grads=True
        )

    def onload(
        self, *, params: bool = False, grads: bool = False, optimizer: bool = False
    ) -> TransferStats:
        return self.offloader.onload(params=params, grads=grads, optimizer=optimizer)
