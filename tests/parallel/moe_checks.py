"""MoE checks for parity_worker.py: Megatron's routers against HF transformers' on one batch.

    hf_router_choices(hf_model, tokens) -> {layer: (chosen [b*s, E] bool, probs [b*s, E])}
    megatron_router_choices_equal(models, positions, forward, hf_routing) -> bool
    router_metrics_match(models, mesh, tokens, positions, hf_routing) -> bool

HF's routers see tokens batch-major ([b, s] flattened), megatron's sequence-major ([s, b]).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from parallel.mesh import Mesh
from parallel.moe import router_load_metrics


def _megatron_routers(models) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in models for m in chunk.modules() if isinstance(m, TopKRouter)]


def hf_router_choices(
    hf_model, tokens: torch.Tensor
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer of HF's model: which experts each token went to, and the router's softmax
    over all experts (fp32)."""
    routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for index, layer in enumerate(hf_model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):  # a dense layer (mlp_only_layers)
            continue

        def hook(module, inputs, outputs, index=index):
            logits, _, indices = outputs  # [b*s, E], _, [b*s, k]
            chosen = torch.zeros(indices.shape[0], module.num_experts, dtype=torch.bool)
            routing[index] = (chosen.scatter(1, indices, True), logits.float().softmax(-1))

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        hf_model(tokens)
    for handle in hooks:
        handle.remove()
    return routing


def megatron_router_choices_equal(
    models, positions: torch.Tensor, forward: Callable[[], object], hf_routing: dict
) -> bool:
    """Every Megatron router on this rank picks, for every token of `forward()`'s batch, the
    experts HF's router of that layer picks."""
    chosen: dict[int, torch.Tensor] = {}
    b, s = positions.shape

    def hook(router, inputs, outputs):
        routing_map = outputs[1].reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        chosen[router.layer_number - 1] = routing_map.cpu()

    handles = [r.register_forward_hook(hook) for r in _megatron_routers(models)]
    forward()
    for handle in handles:
        handle.remove()
    return bool(chosen) and all(torch.equal(hf_routing[i][0], chosen[i]) for i in chosen)


def router_metrics_match(
    models, mesh: Mesh, tokens: torch.Tensor, positions: torch.Tensor, hf_routing: dict
) -> bool:
    """One training-mode forward and backward (what the update runs; pipeline-free, TP1), then
    `router_load_metrics` against the same numbers from HF's choices and probabilities: load
    max/mean (worst layer), cv (mean over layers), unused experts, and the Switch aux loss
    E * sum_e f_e * P_e (f_e: share of the T*k routed slots, P_e: mean probability)."""
    for chunk in models:
        chunk.train()
    with torch.enable_grad():  # the backward runs the dispatcher's collectives backwards too
        models[0](tokens, positions, None).sum().backward()
    for chunk in models:
        chunk.eval()
        chunk.zero_grad(set_to_none=True)
    got = router_load_metrics(models, mesh)
    # Each DP rank routed its own batch: tokens per expert add up over DP; megatron's aux loss
    # is per rank's micro-batch, averaged over DP.
    counts = torch.stack([hf_routing[i][0].sum(0).double() for i in sorted(hf_routing)])
    aux = []
    for chosen, probs in hf_routing.values():
        share = chosen.sum(0).double() / chosen.sum()
        aux.append(chosen.shape[1] * (share * probs.double().mean(0)).sum())
    aux = torch.stack(aux)
    torch.distributed.all_reduce(counts, group=mesh.dp_group)
    torch.distributed.all_reduce(aux, group=mesh.dp_group)
    aux /= mesh.dp
    mean = counts.mean(1)
    expected = {
        "router/load_max_over_mean": (counts.max(1).values / mean).max().item(),
        "router/load_cv": (counts.std(1, correction=0) / mean).mean().item(),
        "router/unused_experts": float((counts == 0).sum().item()),
        "router/aux_loss": aux.mean().item(),
    }
    return got.keys() == expected.keys() and all(
        math.isclose(got[k], expected[k], rel_tol=1e-5, abs_tol=1e-6) for k in expected
    )
