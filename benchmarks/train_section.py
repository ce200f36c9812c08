"""The benchmark's train section: the Megatron actor update (rlcli.model.trained_model) against a plain
HF + torch AdamW loop on the same model, batch and loss; the core attentions
(``model.attention_backend``) side by side on that batch; and on rows of mixed lengths, fixed
micro-batches against a token budget of padded rows and packed sequences
(``actor.pack_sequences``), in real tokens/s and the share of computed tokens that is padding."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.common import (
    SEED,
    device,
    free_memory,
    len_unique_params,
    random_token_ids,
    time_steps,
)
from benchmarks.memory import measure_peak_memory
from benchmarks.workload import Workload, ensure_model
from parallel.step_types import LossReport, MicroBatch, ModelOutputs

if TYPE_CHECKING:
    from parallel.lora import LoraSpec
    from parallel.mesh import Mesh
    from rlcli.model.trained_model import TrainedModel


def nll_loss(outputs: ModelOutputs, micro_batch: MicroBatch):
    """Mean next-token negative log-likelihood of one micro-batch's real tokens:
    outputs.log_probs is [mb, S-1], the log-prob of token t+1 given tokens <= t."""
    mask = micro_batch.attention_mask[:, 1:].to(outputs.log_probs.dtype)
    loss = -(outputs.log_probs * mask).sum() / mask.sum().clamp(min=1)
    return loss, LossReport({"loss": loss.item()})


def throughput(steps: UpdateSteps, tokens_per_step: int, params: int) -> dict:
    # The median step: on a shared machine one slow step would skew a mean.
    tokens_per_s = tokens_per_step / statistics.median(steps.seconds)
    # 6 FLOPs per parameter per token: 2 forward, 4 backward (attention scores not counted).
    return {
        "step_seconds": steps.seconds,
        "warmup_step_seconds": steps.warmup_seconds,
        "tokens_per_s": tokens_per_s,
        "flops_per_s": 6 * params * tokens_per_s,
    }


@dataclass
class UpdateSteps:
    """Seconds of an update's timed steps, and of the warm-up steps before them (the first one,
    which builds the optimizer state, untimed)."""

    seconds: list[float]
    warmup_seconds: list[float]


def time_update(step: Callable[[], None], steps: int, warmup: int) -> UpdateSteps:
    seconds = time_steps(step, warmup - 1 + steps)
    return UpdateSteps(seconds[warmup - 1 :], seconds[: warmup - 1])


def attention_backends() -> list[str]:
    """The core attentions this machine builds: megatron's unfused one, sdpa, and TE's."""
    from parallel.model_backends import transformer_engine_status

    return ["local", "sdpa"] + (["te"] if transformer_engine_status()[0] else [])


def default_attention() -> str:
    """What ``model.attention_backend=auto`` resolves to here."""
    from parallel.model_backends import resolve_backends

    return resolve_backends().attention


def train_section(workload: Workload, work_dir: Path) -> dict:
    w = workload
    model_dir = ensure_model(w.train_model, work_dir / "models", w.dtype)
    rows = w.train_micro_batches * w.train_micro_batch_size
    ids = random_token_ids(rows, w.train_seq_len, w.train_model.vocab_size, SEED).to(device())
    micro_batches = [
        {"input_ids": chunk, "attention_mask": torch.ones_like(chunk)}
        for chunk in ids.split(w.train_micro_batch_size)
    ]
    tokens_per_step = rows * w.train_seq_len
    attention = default_attention()
    result: dict = {
        "model": w.train_model.name,
        "tokens_per_step": tokens_per_step,
        "micro_batches": w.train_micro_batches,
        "micro_batch_size": w.train_micro_batch_size,
        "seq_len": w.train_seq_len,
        "dtype": w.dtype,
        "attention": attention,
    }
    batch = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids))
    # The attention auto resolves to first (its memory is the row's), then the others.
    result["attention_backends"] = {}
    for name in [attention, *(a for a in attention_backends() if a != attention)]:
        with measure_peak_memory() as memory:
            steps, params = megatron_training_steps(
                model_dir, w.dtype, batch, w.train_micro_batch_size, w.train_steps,
                warmup=w.train_warmup_steps, attention=name,
            )  # fmt: skip
            free_memory()
        result["params"] = params
        result["attention_backends"][name] = {
            **throughput(steps, tokens_per_step, params),
            "memory": memory.to_dict(),
        }
    result["megatron"] = result["attention_backends"][attention]

    with measure_peak_memory() as memory:
        steps, hf_params = _hf_training_steps(
            model_dir, micro_batches, w.train_steps, w.train_warmup_steps
        )
        free_memory()
    result["hf_baseline"] = {**throughput(steps, tokens_per_step, hf_params),
                             "memory": memory.to_dict()}  # fmt: skip
    result["megatron_over_hf"] = (
        result["megatron"]["tokens_per_s"] / result["hf_baseline"]["tokens_per_s"]
    )
    result["mixed_lengths"] = _mixed_length_update(w, model_dir)
    return result


def _mixed_length_update(w: Workload, model_dir: Path) -> dict:
    """The actor update on rows of mixed lengths (uniform in [S/8, S]): fixed micro-batches of
    `train_micro_batch_size` rows, a token budget of the same padded size
    (`actor.max_tokens_per_micro_batch` = rows x S), and packed sequences within that budget
    (`actor.pack_sequences`). Tokens/s counts real tokens only."""
    from parallel.micro_batches import micro_batches

    rows = 4 * w.train_micro_batches * w.train_micro_batch_size
    ids = random_token_ids(rows, w.train_seq_len, w.train_model.vocab_size, SEED + 1)
    generator = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(w.train_seq_len // 8, w.train_seq_len + 1, (rows,), generator=generator)
    mask = (torch.arange(w.train_seq_len)[None] < lengths[:, None]).long()
    batch = MicroBatch(input_ids=(ids * mask).to(device()), attention_mask=mask.to(device()))
    real = int(mask.sum())
    out: dict = {"rows": rows, "seq_len": w.train_seq_len, "real_tokens": real}
    budget = w.train_micro_batch_size * w.train_seq_len
    for name, max_tokens, pack in (
        ("fixed", 0, False),
        ("token_budget", budget, False),
        ("packed", budget, True),
    ):
        parts = micro_batches(batch, w.train_micro_batch_size, max_tokens=max_tokens, pack=pack)
        # a packed micro-batch computes exactly its real tokens
        computed = sum(int(p.attention_mask.sum()) if pack else p.input_ids.numel()
                       for p in parts)  # fmt: skip
        steps, _ = megatron_training_steps(
            model_dir, w.dtype, batch, w.train_micro_batch_size, w.train_steps,
            warmup=w.train_warmup_steps, max_tokens=max_tokens, pack=pack,
        )  # fmt: skip
        free_memory()
        out[name] = {
            "micro_batches": len(parts),
            "computed_tokens": computed,
            "padded_fraction": 1 - real / computed,
            "step_seconds": steps.seconds,
            "warmup_step_seconds": steps.warmup_seconds,
            "tokens_per_s": real / statistics.median(steps.seconds),
        }
    # Before per-micro-batch trimming every micro-batch kept the batch-wide S.
    out["batch_wide_padded_fraction"] = 1 - real / (rows * w.train_seq_len)
    out["budget_over_fixed"] = out["token_budget"]["tokens_per_s"] / out["fixed"]["tokens_per_s"]
    out["packed_over_budget"] = out["packed"]["tokens_per_s"] / out["token_budget"]["tokens_per_s"]
    return out


def megatron_actor(
    mesh: Mesh,
    model_dir: Path,
    dtype: str,
    micro_batch_size: int,
    steps: int,
    max_tokens: int = 0,
    lora: LoraSpec | None = None,
    attention: str = "auto",
    pack: bool = False,
) -> TrainedModel:
    """rlcli's actor (`rlcli.model.trained_model.TrainedModel`: megatron-core GPTModel, DDP,
    distributed optimizer off, Adam, clipping at 1.0; `lora`: adapters on the frozen base;
    `attention`: model.attention_backend; `pack`: packed micro-batches)."""
    from parallel.model_options import ModelBuildOptions
    from parallel.optim import OptimizerSettings
    from rlcli.model.trained_model import MicroBatching, TrainedModel

    settings = OptimizerSettings(
        lr=1e-5, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        clip_grad=1.0, warmup_steps=0, total_steps=steps + 1, decay_style="constant",
        use_distributed_optimizer=False,
    )  # fmt: skip
    return TrainedModel(
        mesh,
        str(model_dir),
        dtype=dtype,
        optim=settings,
        micro_batching=MicroBatching(micro_batch_size, max_tokens, pack=pack),
        model_options=ModelBuildOptions(attention_backend=attention),
        lora=lora,
    )


def megatron_training_steps(
    model_dir: Path,
    dtype: str,
    batch: MicroBatch,
    micro_batch_size: int,
    steps: int,
    warmup: int = 1,
    max_tokens: int = 0,
    attention: str = "auto",
    pack: bool = False,
) -> tuple[UpdateSteps, int]:
    """`megatron_actor`'s update on one process: its step times, params."""
    from parallel.mesh import destroy_parallel, init_parallel

    mesh = init_parallel(tp=1, pp=1, seed=SEED)
    actor = megatron_actor(
        mesh, model_dir, dtype, micro_batch_size, warmup + steps, max_tokens, attention=attention,
        pack=pack,
    )  # fmt: skip
    timed = time_update(lambda: actor.train_step(batch, nll_loss), steps, warmup)
    params = len_unique_params(actor.models)
    destroy_parallel()
    return timed, params


def _hf_training_steps(
    model_dir: Path, micro_batches: list[dict[str, torch.Tensor]], steps: int, warmup: int
) -> tuple[UpdateSteps, int]:
    """The loop a user writes without a framework: HF model, torch AdamW, gradient accumulation
    over the same micro-batches and loss (sum of per-micro-batch mean NLL), clipping at 1.0.
    On GPU: fp32 weights and optimizer under bf16 autocast (as Megatron keeps fp32 main
    parameters)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    on_gpu = torch.cuda.is_available()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
                loss = model(input_ids=micro["input_ids"], labels=micro["input_ids"]).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return time_update(step, steps, warmup), len_unique_params([model])
