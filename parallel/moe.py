"""Mixture-of-Experts on megatron-core's MoE layers: the TransformerConfig fields of a MoE model,
and the routers' load per training step.

    is_moe(hf_config) -> bool
    moe_config_fields(hf_config, *, tp, ep, etp, grouped_gemm, aux_loss_coef=None,
                      load_balancing=None, token_dispatcher=None, routing_replay=False) -> dict
    prepare_moe_chunk(chunk) -> None          (build_model calls it for MoE chunks)
    router_load_metrics(models, mesh, prefix="router") -> dict[str, float]
                                                (collective; {} for dense models)

Architecture (experts, top-k, softmax before or after top-k, shared experts, which layers are
MoE) comes from config.json through the model's family (`parallel/convert/qwen3_moe.py`, ...);
the training-time knobs are the load-balancing loss and the token dispatcher:

  load_balancing "aux_loss" (default): the Switch-Transformer loss over each micro-batch,
      E * sum_e f_e * P_e (f_e: share of routed tokens, P_e: mean router probability of expert
      e), scaled by `aux_loss_coef` (default: config.json's router_aux_loss_coef); "seq_aux_loss":
      the same per sequence (DeepSeek-V2); "none": no loss. Megatron adds its gradient in the
      backward pass (MoEAuxLossAutoScaler), averaged over micro-batches and data-parallel ranks.
  token_dispatcher "alltoall" (default) | "allgather": how tokens reach the expert-parallel rank
      of their expert (torch all_to_all_single / all_gather; gloo has both on CPU).

Experts run as megatron's SequentialMLP (one MLP per local expert, no kernel beyond torch) with
the local layers, and as Transformer Engine's grouped GEMM (TEGroupedMLP) with TE's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from parallel.convert.registry import get_family
from parallel.cpu_compat import define_missing_te_gemm, device
from parallel.mesh import Mesh, ParallelLayoutError

MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")
# megatron's tracker names of the load-balancing losses
_TRACKED_LOSS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def architecture_fields(hf_config: Any) -> dict[str, Any]:
    """The family's TransformerConfig fields for `hf_config` (attention and MoE architecture)."""
    return get_family(hf_config.model_type).megatron_options(hf_config)


def is_moe(hf_config: Any) -> bool:
    return architecture_fields(hf_config).get("num_moe_experts") is not None


def moe_config_fields(
    hf_config: Any,
    *,
    tp: int,
    ep: int,
    etp: int,
    grouped_gemm: bool,
    aux_loss_coef: float | None = None,
    load_balancing: str | None = None,
    token_dispatcher: str | None = None,
    routing_replay: bool = False,
) -> dict[str, Any]:
    """TransformerConfig fields of the expert layout and the MoE training knobs (module doc).
    ParallelLayoutError when `ep` / `etp` cannot split the experts; ValueError for a choice
    outside MOE_LOAD_BALANCING / MOE_TOKEN_DISPATCHERS."""
    num_experts = hf_config.num_experts
    if num_experts % ep:
        raise ParallelLayoutError(
            f"parallel.ep={ep} must divide the model's {num_experts} experts "
            "(config.json num_experts)"
        )
    if hf_config.moe_intermediate_size % etp:
        raise ParallelLayoutError(
            f"parallel.expert_tp={etp} must divide the experts' width "
            f"{hf_config.moe_intermediate_size} (config.json moe_intermediate_size)"
        )
    load_balancing = load_balancing or "aux_loss"
    token_dispatcher = token_dispatcher or "alltoall"
    if load_balancing not in MOE_LOAD_BALANCING:
        raise ValueError(f"load balancing {load_balancing!r}: choose one of {MOE_LOAD_BALANCING}")
    if token_dispatcher not in MOE_TOKEN_DISPATCHERS:
        raise ValueError(
            f"token dispatcher {token_dispatcher!r}: choose one of {MOE_TOKEN_DISPATCHERS}"
        )
    if aux_loss_coef is None:
        aux_loss_coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return {
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "moe_grouped_gemm": grouped_gemm,
        "moe_router_load_balancing_type": load_balancing,
        "moe_aux_loss_coeff": aux_loss_coef if load_balancing != "none" else 0.0,
        "moe_token_dispatcher_type": token_dispatcher,
        "moe_permute_fusion": False,  # its kernel is Transformer Engine's
        # the routers' replay hooks (parallel.routing_replay); idle unless a pass arms them
        "moe_enable_routing_replay": routing_replay,
    }


# ---------------------------------------------------------------------------------------------
# Router load


def _count_routed_tokens(router: torch.nn.Module, inputs: tuple, outputs: tuple) -> None:
    """Forward hook on a TopKRouter: add the tokens routed to each expert by a training forward
    (the update's: training mode with autograd on, where megatron also computes the aux loss;
    not the no-grad log-prob passes), padding excluded when the model was given a padding mask."""
    if not (router.training and torch.is_grad_enabled()):
        return
    _, routing_map = outputs  # [tokens, experts] bool
    padding = inputs[1] if len(inputs) > 1 else None  # [s, b] True = padding, or None
    if padding is not None:
        routing_map = routing_map & ~padding.reshape(-1, 1)
    router.routed_tokens += routing_map.sum(dim=0).to(router.routed_tokens.dtype)
    router.training_forwards += 1


def prepare_moe_chunk(chunk: torch.nn.Module) -> None:
    """Count tokens per expert on every router of `chunk` (read by `router_load_metrics`), and
    let megatron's router run without Transformer Engine (`cpu_compat.define_missing_te_gemm`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from parallel.routing_replay import install_measured_replay

    define_missing_te_gemm()
    install_measured_replay(chunk)
    for module in chunk.modules():
        if isinstance(module, TopKRouter):
            module.routed_tokens = torch.zeros(module.config.num_moe_experts, dtype=torch.float64)
            module.training_forwards = 0
            module.register_forward_hook(_count_routed_tokens)


def _routers(models: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    return [m for chunk in models for m in chunk.modules() if hasattr(m, "routed_tokens")]


def router_load_metrics(
    models: Sequence[torch.nn.Module], mesh: Mesh, prefix: str = "router"
) -> dict[str, float]:
    """Load balance of the routers over the training forwards since the last call, on every rank
    (collective over PP, DP and, with sequence parallelism, TP; resets the counts and megatron's
    loss tracker, so call it after each model's update: a critic's with its own `prefix`):

      router/load_max_over_mean   the busiest expert's tokens / the mean per expert, worst MoE
                                  layer (1 = perfectly balanced, E/k = all tokens on k experts)
      router/load_cv              std / mean of the tokens per expert, mean over MoE layers
      router/unused_experts       (layer, expert) pairs that received no token
      router/aux_loss             megatron's load-balancing loss (without its coefficient), mean
                                  over MoE layers and forwards; only when the loss is on
    Dense models: {} (and no collective)."""
    routers = _routers(models)
    if not routers:
        return {}
    config = routers[0].config
    counts = torch.zeros(config.num_layers, config.num_moe_experts, dtype=torch.float64)
    forwards = torch.zeros(config.num_layers, dtype=torch.float64)
    for router in routers:
        counts[router.layer_number - 1] += router.routed_tokens.cpu()
        forwards[router.layer_number - 1] += router.training_forwards
        router.routed_tokens.zero_()
        router.training_forwards = 0
    summed = torch.cat([counts.flatten(), forwards]).to(routers[0].weight.device)
    if mesh.pp > 1:
        dist.all_reduce(summed, group=mesh.pp_group)  # each stage fills its own layers
    dist.all_reduce(summed, group=mesh.dp_group)
    if config.sequence_parallel and mesh.tp > 1:  # each TP rank routed its sequence shard
        dist.all_reduce(summed, group=mesh.tp_group)
    summed = summed.cpu()
    counts = summed[: counts.numel()].view_as(counts)
    forwards = summed[counts.numel() :] / mesh.dp
    layers = counts.sum(dim=1) > 0
    if not layers.any():  # no training forward since the last call (the same on every rank)
        return {}
    used = counts[layers]
    mean = used.mean(dim=1)
    metrics = {
        f"{prefix}/load_max_over_mean": (used.max(dim=1).values / mean).max().item(),
        f"{prefix}/load_cv": (used.std(dim=1, correction=0) / mean).mean().item(),
        f"{prefix}/unused_experts": float((used == 0).sum().item()),
    }
    name = _TRACKED_LOSS.get(config.moe_router_load_balancing_type)
    if name is not None and config.moe_aux_loss_coeff:
        aux = _tracked_loss(name, config.num_layers)
        metrics[f"{prefix}/aux_loss"] = (aux[layers] / forwards[layers].clamp(min=1)).mean().item()
    return metrics


def _tracked_loss(name: str, num_layers: int) -> torch.Tensor:
    """Megatron's tracked load-balancing loss `name` per layer, summed over forwards and averaged
    over DP by its own reduction (collective), then cleared."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
        save_to_aux_losses_tracker,
    )

    # A stage without MoE layers tracked nothing: adding 0 registers the loss with the groups a
    # router uses, so every rank takes part in the same reductions.
    group = parallel_state.get_tensor_and_context_parallel_group()
    save_to_aux_losses_tracker(name, torch.zeros((), device=device()), 1, num_layers, group)
    reduce_aux_losses_tracker_across_ranks([name])
    values = get_moe_layer_wise_logging_tracker()[name]["values"].detach().double().cpu()
    clear_aux_losses_tracker()
    return values[:num_layers]
