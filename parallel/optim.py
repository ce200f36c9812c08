"""Training wrappers on megatron-core: DDP, optimizer + LR schedule, and one optimizer step.

    models = wrap_for_training(build_model(...), mesh)
    optimizer, scheduler = build_optimizer(models, lr=1e-6, ...)
    result = train_step(models, mesh, optimizer, scheduler, micro_batches, loss_fn)

Gradients: ``train_step`` steps on the gradient of the SUM over its micro-batches of
``loss_fn``'s loss (see ``parallel.schedule``), AVERAGED over data-parallel replicas by
megatron's DDP. Gradient clipping (``clip_grad``) acts on the global norm over all model
shards; ``result["grad_norm"]`` is that norm before clipping.

Schedules count optimizer steps: ``warmup_steps`` and ``total_steps`` are numbers of
``train_step`` calls whose update was applied. As in megatron and HF's linear warmup, the
learning rate of step k (from 0) during warmup is ``lr * k / warmup_steps``, so the first
warmup step does not move the weights; decay runs from ``warmup_steps`` to ``total_steps``.
"""

from __future__ import annotations

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
from parallel.schedule import LossFn, forward_backward

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


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


def build_optimizer(
    models: list[DistributedDataParallel],
    *,
    lr: float,
    min_lr: float = 0.0,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    use_distributed_optimizer: bool = False,
    warmup_steps: int = 0,
    total_steps: int = 1,
    decay_style: str = "constant",
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Megatron Adam(W) over the DDP-wrapped chunks, and its LR / weight-decay scheduler.

    Mixed precision follows the model: bf16 / fp16 models get fp32 main params and grads
    (fp16 with dynamic loss scaling). ``clip_grad=0`` disables clipping.
    """
    if decay_style not in DECAY_STYLES:
        raise ValueError(
            f"unknown lr decay style {decay_style!r} (optim.decay_style); "
            f"choose one of {', '.join(DECAY_STYLES)}"
        )
    if not 0 <= warmup_steps < max(total_steps, 1):
        raise ValueError(
            f"optim.warmup_steps={warmup_steps} must be >= 0 and < total steps {total_steps}"
        )
    if models[0].ddp_config.use_distributed_optimizer != use_distributed_optimizer:
        raise ValueError(
            "use_distributed_optimizer differs between wrap_for_training and build_optimizer"
        )
    model_config = get_model_config(models[0])
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        use_distributed_optimizer=use_distributed_optimizer,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
    )
    optimizer = get_megatron_optimizer(config, models)
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
        lr_decay_style=decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def train_step(
    models: list[DistributedDataParallel],
    mesh: Mesh,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_fn: LossFn,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> dict[str, Any]:
    """One optimizer step over ``micro_batches`` (this rank's share of the batch).

    Returns ``{"micro_batch_metrics": [...], "grad_norm": float | None, "lr": float,
    "skipped": bool}`` (the caller reduces the per-micro-batch metrics); ``skipped`` is True when
    the step was not applied (fp16 overflow, or NaN / inf gradients).
    """
    for chunk in models:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # Gradients are reduced over DP (and embedding / layernorm grads over PP / TP) inside the
    # schedule by the config's finalize_model_grads_func, set by wrap_for_training.
    micro_batch_metrics = forward_backward(
        models,
        mesh,
        micro_batches,
        loss_fn,
        forward_only=False,
        temperature=temperature,
        compute_entropy=compute_entropy,
    )
    lr = optimizer.param_groups[0]["lr"]  # the rate this step uses, before the scheduler moves
    applied, grad_norm, _ = optimizer.step()
    if applied:
        scheduler.step(increment=1)
    return {
        "micro_batch_metrics": micro_batch_metrics,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "lr": lr,
        "skipped": not applied,
    }


def reload_master_weights(optimizer: MegatronOptimizer) -> None:
    """Copy the model's current weights into the optimizer's fp32 master copy.

    bf16 / fp16 and distributed optimizers keep fp32 master weights and write them back into
    the model after every step. After model weights were loaded without optimizer state (a
    model-only resume, or new weights from elsewhere) call this, or the next step silently
    reverts the model to the master copy's old values. A no-op for plain fp32 optimizers.
    """
    optimizer.reload_model_params()  # a ChainedOptimizer forwards it to each of its parts
