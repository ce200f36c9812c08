"""One model of the run on Megatron, whatever its role: this rank's TP x PP chunks and, when it
trains, megatron-core's DDP, optimizer and LR schedule; an offloader; how its batches are cut
into micro-batches; and the one mini-batch loop every update runs.

The roles are compositions of this core with their own math:

    actor     = TrainedModel(mesh, hf_dir, optim=..., micro_batching=...)   # + rlcli.train.actor_update
    reference = TrainedModel(mesh, hf_dir, micro_batching=...)              # frozen: log-probs only
    critic    = TrainedModel(mesh, hf_dir, head=ValueHead(), optim=...)     # + rlcli.train.critic
    reward    = TrainedModel(mesh, rm_dir, head=ScoreHead())  # rlcli.reward_models.model_rewards, rlcli rm

    actor     = TrainedModel(..., optim=..., lora=LoraSpec(...))   # LoRA: only adapters train
    reference = LoraReference(actor)        # the same chunks with the adapters off: no 2nd model

The head (``rlcli.model.heads``: language model, value, score) decides how the chunks are loaded
and what the no-grad passes give: ``forward`` the response-aligned outputs ``[B, R]`` of a
``RolloutBatch`` (log-probs of a language-model head, values of a value head) through
``parallel.schedule``, ``score`` a reward model's one score per sequence. ``update`` runs PPO
epochs x mini-batches of whole groups x micro-batches through megatron-core's schedule and
optimizer, with a loss the role supplies; ``train_step`` is one optimizer step
(``train_micro_batches`` when the caller cuts the micro-batches itself, as preference pairs
must be).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

import algorithms
from parallel.dtypes import DTYPES
from parallel.lora import LoraConfigError, LoraSpec, lora_disabled
from parallel.mesh import Mesh
from parallel.micro_batches import micro_batches
from parallel.model_options import ModelBuildOptions
from parallel.offload import Offloader, TransferStats
from parallel.optim import OptimizerSettings
from parallel.step_types import LossFn, MicroBatch, StepResult
from rlcli.errors import UserError
from rlcli.model.dp_stats import DataParallelStats
from rlcli.model.heads import LanguageModelHead, ModelHead
from rlcli.rollout.batch import RolloutBatch, split_evenly

if TYPE_CHECKING:
    from parallel.routing_replay import RoutingNotes
    from rlcli.config.schema import TrainedModelConfig


def optimizer_settings(
    section: TrainedModelConfig,
    *,
    total_steps: int,
    use_distributed_optimizer: bool,
    lr: float | None = None,
    warmup_steps: int | None = None,
) -> OptimizerSettings:
    """A section's Adam(W) and schedule (``actor.*`` / ``critic.*``); ``lr`` and
    ``warmup_steps`` override the section's (the SFT warm start has its own)."""
    return OptimizerSettings(
        lr=section.lr if lr is None else lr,
        min_lr=section.min_lr,
        weight_decay=section.weight_decay,
        adam_beta1=section.adam_beta1,
        adam_beta2=section.adam_beta2,
        adam_eps=section.adam_eps,
        clip_grad=section.grad_clip,
        warmup_steps=section.lr_warmup_steps if warmup_steps is None else warmup_steps,
        total_steps=total_steps,
        decay_style=section.lr_decay_style,
        use_distributed_optimizer=use_distributed_optimizer,
    )


@dataclass(frozen=True)
class MicroBatching:
    """How a model's batches are cut (``parallel.micro_batches``): ``size`` rows each, or by a
    token budget: ``max_tokens`` for the training passes, ``max_tokens_forward`` for the no-grad
    ones (0: ``max_tokens``). ``pack``: each micro-batch is one packed row of whole sequences
    up to that budget (``parallel.schedule.forward_backward(pack_sequences=True)``); the model
    is then built for it."""

    size: int
    max_tokens: int = 0
    max_tokens_forward: int = 0
    pack: bool = False

    @classmethod
    def of(cls, section: TrainedModelConfig) -> MicroBatching:
        return cls(
            section.micro_batch_size,
            section.max_tokens_per_micro_batch,
            section.max_tokens_per_forward,
            section.pack_sequences,
        )

    @property
    def forward_tokens(self) -> int:
        return self.max_tokens_forward or self.max_tokens


# (mini-batch, its DP share of the loss denominator, optimizer steps taken so far) -> loss
LossFactory = Callable[[RolloutBatch, torch.Tensor, int], LossFn]


class TrainedModel:
    """This rank's chunks of one model (+ optimizer and schedule when ``optim`` is given)."""

    def __init__(
        self,
        mesh: Mesh,
        hf_dir: str,
        *,
        micro_batching: MicroBatching,
        head: ModelHead = LanguageModelHead(),
        dtype: str = "float32",
        optim: OptimizerSettings | None = None,
        model_options: ModelBuildOptions = ModelBuildOptions(),
        lora: LoraSpec | None = None,
        adapter_path: str | None = None,
    ) -> None:
        """``head``: what sits on the last layer (``rlcli.model.heads``; default the language
        model's). ``model_options``: how ``parallel.model.build_model`` lays the model out
        (``micro_batching.pack`` decides packed sequences); a setting this machine cannot build
        is a UserError. ``optim``: the model trains (megatron DDP, Adam(W) and its schedule).
        ``lora``: LoRA adapters on the frozen base, added before DDP and the optimizer, which
        then hold only the adapters; ``adapter_path``: a PEFT adapter folder to start from."""
        from parallel.model import ModelConfigError

        self.mesh, self.hf_dir, self.head = mesh, hf_dir, head
        self.micro_batching = micro_batching
        self.lora = lora
        try:
            models = head.load(hf_dir, mesh, DTYPES[dtype], model_options, micro_batching.pack)
            if lora is not None:
                from parallel.lora import apply_lora
                from parallel.lora_io import load_peft_adapter

                apply_lora(models, lora)
                if adapter_path:
                    load_peft_adapter(models, mesh, adapter_path)
        except (ModelConfigError, LoraConfigError) as err:
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
                models, replace(optim, total_steps=max(1, optim.total_steps))
            )
        self.models = models
        self.offloader = Offloader(models, self.optimizer)
        # The RL trainer steps the LR schedule once per RL step (``advance_schedule``) and sets
        # this False; SFT keeps one schedule step per optimizer step.
        self.schedule_per_update = True
        self.nonfinite_updates = 0  # optimizer steps dropped for a non-finite loss or gradient

    @torch.no_grad()
    def forward(self, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
        """Response-aligned ``[B, R]`` outputs under the current weights, float32 on the CPU:
        the response tokens' log-probs (a language-model head; at ``temperature``) or the values
        of the positions that predict them (a value head; zero where ``loss_mask`` is 0)."""
        with self._without_dropout():
            return self.head.forward(self, batch, temperature)

    @torch.no_grad()
    def forward_and_routing(
        self, batch: RolloutBatch, temperature: float = 1.0
    ) -> tuple[torch.Tensor, RoutingNotes]:
        """``forward``'s log-probs and what the pass noted of its MoE routing: without
        ``batch.routing`` the experts every token went to in this rank's MoE layers
        (``notes.recorded [B, S, L, k]``, for the update to replay), with it a replay of those
        and the share the router would have changed (``notes.changed``)
        (``parallel.routing_replay``; the model is built with ``MoeOptions(routing_replay=True)``)."""
        with self._without_dropout():
            return self.head.forward_and_routing(self, batch, temperature)

    @torch.no_grad()
    def forward_top(
        self, batch: RolloutBatch, temperature: float, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward``'s ``[B, R]`` log-probs and, at every position, the ``top_k`` likeliest
        next tokens: their log-probs ``[B, S, top_k]`` (float32) and ids (int64), on the CPU,
        likeliest first (the last position, which scores nothing, holds zeros). Padded
        micro-batches only (``micro_batching.pack`` is not used)."""
        with self._without_dropout():
            return self.head.forward_top(self, batch, temperature, top_k)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """A reward model's scores ``[B]`` (float32, on every model-parallel rank) of the
        right-padded sequences ``input_ids / attention_mask [B, S]``, in micro-batches of
        ``micro_batching.size`` rows or its no-grad token budget, packed with
        ``micro_batching.pack`` (``parallel.reward_model.score_sequences``)."""
        return self.head.score(self, input_ids, attention_mask)

    @contextmanager
    def _without_dropout(self) -> Iterator[None]:
        """A no-grad pass must score the policy itself, not a dropout sample of it: the chunks
        go to eval mode for it when the LoRA adapters have dropout (the base has none)."""
        if self.lora is None or not self.lora.dropout:
            yield
            return
        modes = [chunk.training for chunk in self.models]
        for chunk in self.models:
            chunk.eval()
        try:
            yield
        finally:
            for chunk, training in zip(self.models, modes, strict=True):
                chunk.train(training)

    def train_step(
        self,
        batch: MicroBatch,
        loss_fn: LossFn,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> StepResult:
        """One optimizer step over a batch (a ``RolloutBatch``, or any ``MicroBatch`` with what
        ``loss_fn`` reads) cut into micro-batches of its type: gradients summed over
        micro-batches, averaged over DP (see ``parallel.optim.train_step``)."""
        chunks = micro_batches(
            batch,
            self.micro_batching.size,
            equal_sizes=self.mesh.pp > 1,
            max_tokens=self.micro_batching.max_tokens,
            pack=self.micro_batching.pack,
        )
        return self.train_micro_batches(chunks, loss_fn, temperature, compute_entropy)

    def train_micro_batches(
        self,
        chunks: list[MicroBatch],
        loss_fn: LossFn,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> StepResult:
        """``train_step`` on micro-batches the caller cut (all of one size under pipeline
        parallelism), e.g. preference pairs kept together (``parallel.reward_training``)."""
        from parallel.optim import train_step

        result = train_step(
            self.models,
            self.mesh,
            self.optimizer,
            self.scheduler,
            chunks,
            loss_fn,
            temperature=temperature,
            compute_entropy=compute_entropy,
            step_scheduler=self.schedule_per_update,
            pack_sequences=self.micro_batching.pack,
        )
        self.nonfinite_updates += result.nonfinite
        return result

    def update(
        self,
        batch: RolloutBatch,
        loss_for: LossFactory,
        *,
        epochs: int,
        num_mini_batches: int,
        loss_agg_mode: str,
        norm_length: int,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> list[StepResult]:
        """``epochs`` x ``num_mini_batches`` optimizer steps on this DP rank's share of the
        batch; each step's ``train_step`` result, in order.

        ``batch`` holds this rank's whole groups; it is cut into the same number of mini-batches
        on every DP rank (so optimizer steps line up), each a run of whole groups. The loss of a
        mini-batch comes from ``loss_for(mini, denominator, steps_so_far)``, where
        ``denominator`` is this rank's share of the mini-batch's global ``loss_agg_mode``
        denominator: megatron's DDP averages gradients over DP, so each rank divides by
        (global denominator / dp) and the average is exact."""
        groups = batch.group_index
        stats = DataParallelStats(self.mesh)
        results: list[StepResult] = []
        for _ in range(epochs):
            for chunk in split_evenly(torch.unique_consecutive(groups).tolist(), num_mini_batches):
                mini = batch.select(torch.isin(groups, torch.tensor(chunk)))
                denominator = algorithms.agg_loss_denominator(
                    mini.loss_mask, loss_agg_mode, norm_length=norm_length
                ).double()
                denominator = (stats.sum(denominator) / self.mesh.dp).float()
                loss_fn = loss_for(mini, denominator, len(results))
                step = self.train_step(mini, loss_fn, temperature, compute_entropy)
                results.append(step)
        return results

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


class LoraReference:
    """The reference policy of a LoRA actor: the actor's own chunks with the adapters switched
    off (``parallel.lora.lora_disabled``), i.e. the frozen base. No second model and no memory of
    its own: the residency plan's ``ref`` row asks for the actor's params."""

    def __init__(self, actor: TrainedModel) -> None:
        if actor.lora is None:
            raise ValueError("LoraReference needs an actor with LoRA adapters")
        self.actor = actor

    @torch.no_grad()
    def forward(self, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
        """The base model's ``[B, R]`` response log-probs (``TrainedModel.forward``)."""
        with lora_disabled(self.actor.models):
            return self.actor.forward(batch, temperature)
