"""Training wrappers on megatron-core: DDP, optimizer + LR schedule, and one optimizer step.

    models = wrap_for_training(build_model(...), mesh)
    optimizer, scheduler = build_optimizer(models, OptimizerSettings(lr=1e-6, ...))
    result = train_step(models, mesh, optimizer, scheduler, micro_batches, loss_fn)

Gradients: ``train_step`` steps on the gradient of the SUM over its micro-batches of
``loss_fn``'s loss (see ``parallel.schedule``), AVERAGED over data-parallel replicas by
megatron's DDP. Gradient clipping (``clip_grad``) acts on the global norm over all model
shards; ``result.grad_norm`` is that norm before clipping.

Schedules count optimizer steps: ``warmup_steps`` and ``total_steps`` are numbers of
``train_step`` calls whose update was applied, unless the caller passes ``step_scheduler=False``
and steps the scheduler itself (an RL trainer steps it once per RL step, however many optimizer
steps that holds). As in megatron and HF's linear warmup, the learning rate of step k (from 0)
during warmup is ``lr * k / warmup_steps``, so the first warmup step does not move the weights;
decay runs from ``warmup_steps`` to ``total_steps``. The scheduler is built to take its values
from the code (the current config), not from a checkpoint it is loaded from.

Non-finite steps: megatron-core's fp32 / bf16 optimizers step even on NaN / inf gradients (only
the fp16 loss scaler skips them). ``train_step`` therefore checks the loss and the gradients
first, agrees on the answer over all ranks, and drops such a step without touching the weights,
the optimizer state or the schedule (``result.nonfinite``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from parallel.mesh import Mesh
from parallel.schedule import forward_backward
from parallel.step_types import LossFn, LossReport, MicroBatch, StepResult


def wrap_for_training(
    models: list[torch.nn.Module],
    mesh: Mesh,
    *,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool = True,
    overlap_grad_reduce: bool = False,
    bucket_size: int | None = None,
) -> list[DistributedDataParallel]:
    """Wrap each model chunk in megatron DDP and point the model config at its grad hooks.

    ``use_distributed_optimizer`` must match ``build_optimizer``'s (the gradient buffers are
    laid out for it). Parameters are broadcast from DP rank 0 so replicas start identical
    even if their initialisation differed.
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        # gloo has no AVG reduction: DDP pre-scales by 1/dp and sums instead.
        average_in_collective=False,
    )
    wrapped = [
        DistributedDataParallel(
            config=get_model_config(chunk),
            ddp_config=ddp_config,
            module=chunk,
            # As megatron's own training loop: only the first chunk's buffers are bucketed,
            # so later chunks' gradients are reduced in one piece.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(models)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()

    config = get_model_config(wrapped[0])
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        # Let the pipeline schedule launch each chunk's reduction as soon as its last
        # micro-batch is through backward, instead of all at the end.
        no_sync = [chunk.no_sync for chunk in wrapped]
        start_sync = [chunk.start_grad_sync for chunk in wrapped]
        config.no_sync_func = no_sync[0] if len(wrapped) == 1 else no_sync
        config.grad_sync_func = start_sync[0] if len(wrapped) == 1 else start_sync
    return wrapped


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam(W) and its LR / weight-decay schedule (``build_optimizer``). ``clip_grad=0``
    disables clipping; ``decay_style`` is one of megatron-core's (constant, linear, cosine,
    inverse-square-root; it rejects others); ``warmup_steps`` and ``total_steps`` count
    optimizer steps (module docstring). ``use_distributed_optimizer`` must match
    ``wrap_for_training``'s."""

    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    warmup_steps: int = 0
    total_steps: int = 1
    decay_style: str = "constant"


def build_optimizer(
    models: list[DistributedDataParallel], settings: OptimizerSettings
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Megatron Adam(W) over the DDP-wrapped chunks, and its LR / weight-decay scheduler, as
    ``settings`` say. Mixed precision follows the model: bf16 / fp16 models get fp32 main params
    and grads (fp16 with dynamic loss scaling).
    """
    o = settings
    lr, min_lr, weight_decay = o.lr, o.min_lr, o.weight_decay
    warmup_steps, total_steps = o.warmup_steps, o.total_steps
    if not 0 <= warmup_steps < max(total_steps, 1):
        raise ValueError(
            f"optim.warmup_steps={warmup_steps} must be >= 0 and < total steps {total_steps}"
        )
    if models[0].ddp_config.use_distributed_optimizer != o.use_distributed_optimizer:
        raise ValueError(
            "use_distributed_optimizer differs between wrap_for_training and build_optimizer"
        )
    model_config = get_model_config(models[0])
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        use_distributed_optimizer=o.use_distributed_optimizer,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
    )
    optimizer = get_megatron_optimizer(config, models)
    _use_fused_cpu_adam(optimizer)
    # The schedule multiplies each loss by this (1 without fp16 loss scaling), as megatron's
    # training loop does.
    model_config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_steps else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, 1),
        lr_decay_style=o.decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
        # A resumed run follows the schedule of the config it is started with (a changed lr or
        # a longer run takes effect); only the step count comes from the checkpoint.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The megatron optimizers inside a ChainedOptimizer, or [optimizer]."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _use_fused_cpu_adam(optimizer: MegatronOptimizer) -> None:
    """Switch megatron's torch Adam(W) to torch's fused kernel where its params live on the CPU.

    Without Transformer Engine or apex, megatron-core falls back to ``torch.optim.AdamW`` (or Adam) with
    its default (unfused, per-tensor) implementation. torch's fused CPU kernel computes the
    same update in one pass over each tensor: at the 25M-parameter benchmark shape it halved
    the optimizer step (66 -> 34 ms on a 2-core AMD EPYC). GPU runs keep megatron's own choice.
    It must be set before the first step, while the Adam state is still empty.
    """
    for sub_optimizer in sub_optimizers(optimizer):
        inner = getattr(sub_optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        for options in [inner.defaults, *inner.param_groups]:
            options["fused"] = True
            options["foreach"] = False


def train_step(
    models: list[DistributedDataParallel],
    mesh: Mesh,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    step_scheduler: bool = True,
    pack_sequences: bool = False,
) -> StepResult:
    """One optimizer step over ``micro_batches`` (this rank's share of the batch); with
    ``pack_sequences`` each runs as one packed row (``parallel.schedule.forward_backward``).

    Returns a ``StepResult`` (the caller reduces the per-micro-batch reports); ``skipped`` is
    True when the step was not applied (fp16 overflow, or a non-finite loss or gradient: then
    ``nonfinite`` is True too, on every rank alike). ``step_scheduler=False`` leaves the LR
    schedule to the caller.
    """
    for chunk in models:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # Gradients are reduced over DP (and embedding / layernorm grads over PP / TP) inside the
    # schedule by the config's finalize_model_grads_func, set by wrap_for_training.
    results = forward_backward(
        models,
        mesh,
        micro_batches,
        loss_fn,
        forward_only=False,
        temperature=temperature,
        compute_entropy=compute_entropy,
        pack_sequences=pack_sequences,
    )
    lr = optimizer.param_groups[0]["lr"]  # the rate this step uses, before the scheduler moves
    # fp16 overflows are the loss scaler's business (it must see them to lower the scale); for
    # fp32 / bf16 nothing downstream would stop a NaN, so check before the optimizer runs.
    reports = [result.report for result in results]
    changed = [r.routing_changed for r in results if r.routing_changed is not None]
    routing_changed = torch.stack(changed).sum(dim=0) if changed else None
    fp16 = get_model_config(models[0]).fp16
    if not all_agree_finite(models, reports, check_grads=not fp16):
        for chunk in models:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        return StepResult(
            reports, grad_norm=float("nan"), lr=lr, skipped=True, nonfinite=True,
            routing_changed=routing_changed,
        )  # fmt: skip
    applied, grad_norm, _ = optimizer.step()
    if applied and step_scheduler:
        scheduler.step(increment=1)
    return StepResult(
        reports,
        grad_norm=None if grad_norm is None else float(grad_norm),
        lr=lr,
        skipped=not applied,
        routing_changed=routing_changed,
    )


def _model_device(models: list[torch.nn.Module]) -> torch.device:
    for parameter in models[0].parameters():
        return parameter.device
    return torch.device("cpu")


def _all_ranks_true(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce of a flag over the world)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0


def all_agree_finite(
    models: list[DistributedDataParallel],
    reports: list[LossReport],
    check_grads: bool = True,
) -> bool:
    """True when, on EVERY rank, the losses (the micro-batches' ``reports``) and the gradient
    buffers are finite. Each rank checks its own shard (TP / PP split the gradients; DP ranks
    hold the same reduced values); one flag all-reduced over the world makes all ranks answer
    alike."""
    ok = all(report.is_finite() for report in reports)
    if ok and check_grads:
        for chunk in models:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                if not _all_finite(buffer.grad_data):
                    ok = False
                    break
    return _all_ranks_true(ok, _model_device(models))


def _all_finite(tensor: torch.Tensor) -> bool:
    """Exact, and cheap when the answer is yes: a NaN or an infinity makes the sum non-finite, so
    one summing pass (a few ms per 25M elements on CPU, where ``isfinite().all()`` took 75 ms)
    settles the common case; a non-finite sum (or one that overflowed) gets the elementwise look."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def all_weights_finite(models: list[torch.nn.Module]) -> bool:
    """Collective: True when every rank's weights are all finite (checked before a save, so a
    checkpoint never holds a NaN)."""
    ok = all(_all_finite(p.detach()) for chunk in models for p in chunk.parameters())
    return _all_ranks_true(ok, _model_device(models))


# Param-group entries that come from the config; a loaded optimizer state must not replace them.
_GROUP_SKIP = ("params", "lr", "weight_decay", "step")


def group_hyperparameters(optimizer: MegatronOptimizer) -> list[dict[str, Any]]:
    """The configured hyper-parameters of each param group (betas, eps, max_lr, min_lr, ...)."""
    return [
        {k: v for k, v in group.items() if k not in _GROUP_SKIP} for group in optimizer.param_groups
    ]


def restore_group_hyperparameters(
    optimizer: MegatronOptimizer, configured: list[dict[str, Any]]
) -> list[str]:
    """Put the configured values back into the param groups after a state load; returns
    ``"name: checkpoint -> config"`` for each value that differed."""
    changed: list[str] = []
    for group, wanted in zip(optimizer.param_groups, configured, strict=True):
        for key, value in wanted.items():
            if group.get(key) != value:
                line = f"optimizer {key}: {group.get(key)} -> {value}"
                if line not in changed:
                    changed.append(line)
            group[key] = value
    return changed


def reload_master_weights(optimizer: MegatronOptimizer) -> None:
    """Copy the model's current weights into the optimizer's fp32 master copy.

    bf16 / fp16 and distributed optimizers keep fp32 master weights and write them back into
    the model after every step. After model weights were loaded without optimizer state (a
    model-only resume, or new weights from elsewhere) call this, or the next step silently
    reverts the model to the master copy's old values. A no-op for plain fp32 optimizers.
    """
    optimizer.reload_model_params()  # a ChainedOptimizer forwards it to each of its parts
