"""Distributed checkpoints of model chunks, optimizer and LR scheduler (megatron dist_checkpointing).

    save_checkpoint(ckpt_dir, models, mesh, optimizer=None, scheduler=None)   # collective
    load_checkpoint(ckpt_dir, models, mesh, optimizer=None, scheduler=None, strict=True)

``adapters_only=True`` (both): only the model's LoRA adapters (``parallel.lora``) and, with the
optimizer, their optimizer state (a LoRA optimizer holds nothing else); the frozen base is not
written and, on load, keeps the weights it was built with (the HF model it came from).

Every rank writes only the shards it owns (replicated tensors are written once: the writes
are spread over data-parallel ranks), in megatron's ``torch_dist`` format: tensors are keyed
by their GLOBAL name and offsets, so a checkpoint reads back at another TP / PP / VPP / DP
layout than it was written with.

What reshards:
  * the model: any TP / PP / VPP / DP (tested: written at TP2, read at TP1 and at PP2);
  * the plain (non-distributed) optimizer: its state is stored per model parameter, so it
    reads back at another layout too (tested: TP2 -> TP1 x DP2, next step equal);
  * the distributed optimizer: saved in megatron's "fully_reshardable" format (gathered over
    DP; documented reshardable in TP, PP and DP). Loading it needs Transformer Engine or
    Apex: with torch's own Adam (CPU) megatron-core 0.16 cannot restore it, and
    ``load_checkpoint`` says so up front (the model part of such a checkpoint loads fine).
    The two optimizer kinds do not read each other's checkpoints (the distributed one also
    stores fp32 main parameters);
  * the scheduler: a small plain dict, stored once (rank 0) and read on every rank.

Pitfalls: megatron-core's filesystem writer needs ``psutil`` and starts a
``multiprocessing`` Manager with the spawn method at the first save (kept for the life of the
process; no strategy option avoids it), so the entry script must be guarded by
``if __name__ == "__main__":``, or the child re-imports it and hangs. A SIGKILLed process leaves
that Manager running unless the child is told to die with it: the ``rlcli`` entry point does so
as the child imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import unwrap_model

from parallel.cpu_compat import match_saved_param_groups
from parallel.lora import ADAPTER_SUFFIX
from parallel.mesh import Mesh
from parallel.optim import sub_optimizers

# Optimizer state per model parameter, gathered over DP for the distributed optimizer:
# readable at any TP / PP / DP. Ignored by the plain optimizer, which is always per parameter.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    models: list[torch.nn.Module],
    mesh: Mesh,
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    adapters_only: bool = False,
) -> None:
    """Write the model chunks (and optimizer / scheduler state when given) to ``ckpt_dir``
    (``adapters_only``: of the model, only its LoRA adapters).

    Collective over all ranks. ``ckpt_dir`` is created if needed; it should be empty (an
    existing checkpoint there is overwritten file by file, not removed).
    """
    ckpt_dir = Path(ckpt_dir)
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(models, optimizer, scheduler, is_loading=False, adapters=adapters_only)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), mesh.dp_group)
    dist_checkpointing.save(state, str(ckpt_dir), sharded_strategy=strategy)
    dist.barrier()


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    models: list[torch.nn.Module],
    mesh: Mesh,
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    strict: bool = True,
    adapters_only: bool = False,
) -> list[str]:
    """Fill ``models`` (and ``optimizer`` / ``scheduler`` when given) from ``ckpt_dir``.

    The optimizer's state (moments, master weights) and the scheduler's step count come from
    the checkpoint; its hyper-parameters (lr, min lr, warmup, decay, weight decay, betas, eps)
    stay those the optimizer and scheduler were built with, i.e. the current config. Returns
    one line per hyper-parameter whose checkpoint value differed (``"name: old -> new"``).

    Collective. The models must be built for this rank's layout (``build_model``; bare or
    DDP-wrapped). Entries of the checkpoint that are not asked for are ignored (so a
    model-only load of a model + optimizer checkpoint is fine); ``strict=False`` also
    tolerates asked-for tensors missing from the checkpoint (they keep their current values,
    with a warning). Without an optimizer, a bf16 / fp16 / distributed optimizer built before
    this call still holds the old fp32 main weights and its next step would write them back:
    call ``parallel.optim.reload_master_weights(optimizer)`` after a model-only load.
    ``adapters_only``: read only the LoRA adapters (a checkpoint saved that way); the rest of
    the model keeps its weights.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{ckpt_dir} is not a distributed checkpoint (no metadata.json); pass the directory "
            f"that save_checkpoint wrote"
        )
    changed: list[str] = []
    if optimizer is not None and not _holds_optimizer_moments(ckpt_dir):
        # Adam creates its moments at its first step: a run saved before any optimizer step (or
        # with save_optimizer off) has none to give, and asking megatron for them fails. The
        # fresh optimizer is what was saved; its fp32 master weights must follow the model.
        from parallel.optim import reload_master_weights

        changed += load_checkpoint(
            ckpt_dir, models, mesh, None, scheduler, strict, adapters_only=adapters_only
        )
        reload_master_weights(optimizer)
        return [*changed, "optimizer: the checkpoint holds no Adam moments; starting them fresh"]
    if optimizer is not None:
        _check_optimizer_loadable(optimizer)
    state = _sharded_state(models, optimizer, scheduler, is_loading=True, adapters=adapters_only)
    strategy = FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(ckpt_dir)), mesh.dp_group
    )
    loaded = dist_checkpointing.load(
        state,
        str(ckpt_dir),
        sharded_strategy=strategy,
        # "Unexpected" = requested but absent from the checkpoint. Checkpoint entries that were
        # not requested (e.g. optimizer state when loading only the model) are always fine.
        strict=StrictHandling.RAISE_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED,
    )
    for key, chunk in zip(_model_keys(models), unwrap_model(models), strict=True):
        if adapters_only:
            missing = chunk.load_state_dict(loaded[key], strict=False).missing_keys
            adapters_missing = [name for name in missing if _is_adapter_key(name)]
            if strict and adapters_missing:
                raise RuntimeError(f"{ckpt_dir}: no LoRA adapter tensor {adapters_missing[0]}")
        else:
            chunk.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        from parallel.optim import group_hyperparameters, restore_group_hyperparameters

        configured = group_hyperparameters(optimizer)
        saved_values = match_saved_param_groups(optimizer, loaded["optimizer"])
        optimizer.load_state_dict(loaded["optimizer"])
        for group, values in zip(optimizer.param_groups, saved_values, strict=True):
            group.update(values)  # as saved, so the report below compares like with like
        changed += restore_group_hyperparameters(optimizer, configured)
    if scheduler is not None:
        current = scheduler.state_dict()
        saved = loaded["scheduler"]
        changed += [
            f"scheduler {key}: {saved[key]} -> {value}"
            for key, value in current.items()
            if key != "num_steps" and key in saved and saved[key] != value
        ]
        # Built with override_opt_param_scheduler: only num_steps is taken from the checkpoint.
        scheduler.load_state_dict(saved)
    return changed


def _holds_optimizer_moments(ckpt_dir: Path) -> bool:
    """Whether the checkpoint has per-parameter optimizer tensors (Adam's moments)."""
    tensors = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    return any(key.startswith("optimizer.") for key in tensors)


def _check_optimizer_loadable(optimizer: MegatronOptimizer) -> None:
    """Refuse a load megatron-core cannot do, before anything is modified.

    A distributed optimizer whose inner optimizer is torch's own Adam (no Transformer Engine
    or Apex, e.g. on CPU) cannot be restored by megatron-core 0.16: its ``state_dict()``
    asserts a per-parameter ``step`` that a fresh optimizer lacks, and its parameter-state
    loaders skip ``step`` in the checkpoint but still expect it (``KeyError: 'step'``).
    """
    for sub_optimizer in sub_optimizers(optimizer):
        if isinstance(sub_optimizer, DistributedOptimizer) and isinstance(
            sub_optimizer.optimizer, torch.optim.Adam | torch.optim.AdamW
        ):
            raise NotImplementedError(
                "loading distributed-optimizer state needs Transformer Engine or Apex (their "
                "fused Adam); with torch's Adam megatron-core cannot restore it. Load the "
                "model only (optimizer=None), or train with use_distributed_optimizer=False."
            )


def _is_adapter_key(name: str) -> bool:
    """A LoRA adapter tensor's state-dict key (...linear_qkv_lora.q_proj.lora_A)."""
    return f"{ADAPTER_SUFFIX}." in name


def _model_keys(models: list[torch.nn.Module]) -> list[str]:
    # Megatron's own naming. Tensor keys inside are global, so this nesting does not tie a
    # checkpoint to a number of virtual stages.
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _sharded_state(
    models: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    *,
    is_loading: bool,
    adapters: bool = False,
) -> dict[str, Any]:
    # Unwrapped (no DDP "module." prefix), as megatron's own checkpointing does.
    state: dict[str, Any] = {
        key: chunk.sharded_state_dict()
        for key, chunk in zip(_model_keys(models), unwrap_model(models), strict=True)
    }
    if adapters:
        # The optimizer's entries are built from these: a LoRA optimizer tracks only adapters.
        state = {
            key: {name: value for name, value in entries.items() if _is_adapter_key(name)}
            for key, entries in state.items()
        }
    if optimizer is not None:
        # Built from the model entries: optimizer state is keyed by the model tensors' names.
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        )
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state
