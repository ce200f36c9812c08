"""MoE routing replay (R2): a later forward of the same rows routes every token to the experts
an earlier forward chose, on megatron-core's ``RouterReplay`` hook in ``TopKRouter``.

    build_model(..., options=ModelBuildOptions(moe=MoeOptions(routing_replay=True)))
    results = forward_backward(..., forward_only=True, record_routing=True)
    results[i].routing                     # [mb, S, L, k] int16: experts per token and layer
    batch.routing = ...                    # a sequence field of the micro-batch type
    forward_backward(...)                  # micro-batches with ``routing`` replay it
    results[i].routing_changed             # [2] float64: (token-layers whose own top-k differs
                                           #  from the replayed one, token-layers)

Why: the PPO ratio compares the update's log-probs with the old pass's; in a MoE model a small
weight change flips some tokens to other experts, and the ratio then measures the flip, not the
policy change (verl's and slime's "R2"). Replaying keeps the experts and recomputes only their
gate weights from the current router (megatron gathers the current scores at the replayed
indices), so the router still learns.

``L`` counts this rank's MoE layers (its pipeline stage's, chunk by chunk in model order), ``k``
the router's top-k; token order is the model's (``parallel.model_inputs`` lays it out and puts
it back per row). Positions without a recorded choice (padding) replay experts ``0..k-1``; no
loss reads them.

Limits (refused, not approximated): sequence parallelism (each tensor-parallel rank routes its
own slice of the tokens; recording would need a gather over the TP group, not written yet), and
activation recomputation with pipeline parallelism (a recomputed forward in the backward pass
runs after later micro-batches set their targets; without pipelining each micro-batch's backward
follows its own forward, so recomputation is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.utils import get_model_config

from parallel.mesh import Mesh
from parallel.model_inputs import ModelInputs
from parallel.step_types import MicroBatch, MicroBatchResult


class MeasuredReplay(RouterReplay):
    """megatron's per-layer replay, which also notes, while replaying, the tokens whose own top-k
    (what the router would choose now) differs from the replayed one: ``changed [tokens]``."""

    def __init__(self) -> None:
        super().__init__()
        # megatron's instance list is process-wide and grows with every model built; rlcli holds
        # each model's routers itself (``routers_of``), so it stays out of that list.
        RouterReplay.global_router_replay_instances.remove(self)
        self.changed: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):  # fmt: skip
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            _, own = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            target = self.target_topk_idx.to(own.device)
            self.changed = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


@dataclass
class RoutingNotes:
    """What a no-grad pass over a batch noted of its routing (this rank's MoE layers):
    ``recorded [b, S, L, k]`` int16 when it recorded, ``changed`` float64 ``[2]`` (token-layers
    whose own experts differed from the replayed ones, token-layers) when it replayed."""

    recorded: torch.Tensor | None = None
    changed: torch.Tensor | None = None

    def add(self, result: MicroBatchResult, row_index: torch.Tensor, shape: torch.Size) -> None:
        """One micro-batch's result (its rows ``row_index`` of a batch of ``shape [b, S]``)."""
        if result.routing is not None:
            if self.recorded is None:
                size = (*shape, *result.routing.shape[2:])
                self.recorded = torch.zeros(size, dtype=result.routing.dtype)
            self.recorded[row_index, : result.routing.shape[1]] = result.routing
        if result.routing_changed is not None:
            before = 0 if self.changed is None else self.changed
            self.changed = before + result.routing_changed

    @property
    def changed_share(self) -> float | None:
        if self.changed is None:
            return None
        return float(self.changed[0] / self.changed[1].clamp(min=1))


def install_measured_replay(chunk: torch.nn.Module) -> None:
    """Give every router of ``chunk`` built with ``moe_enable_routing_replay`` a
    ``MeasuredReplay`` in place of megatron's own (which leaves megatron's global list)."""
    for router in _routers(chunk):
        if router.router_replay is not None and not isinstance(
            router.router_replay, MeasuredReplay
        ):
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.router_replay = MeasuredReplay()


def _routers(chunk: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


def routers_of(chunk: torch.nn.Module) -> list[MeasuredReplay]:
    """The replay hooks of ``chunk``'s MoE layers in model order; ValueError when the chunk was
    built without routing replay."""
    replays = [r.router_replay for r in _routers(chunk)]
    if not all(isinstance(r, MeasuredReplay) for r in replays):
        raise ValueError(
            "routing replay needs a model built with ModelBuildOptions(moe=MoeOptions("
            "routing_replay=True))"
        )
    return replays


class RoutingPass:
    """One ``forward_backward`` call's recording (or replaying), chunk by chunk.

    ``before(chunk, routing)`` arms the chunk's routers for its next micro-batch (``routing``:
    ``[tokens, L, k]`` in the model's token order when replaying); ``after(chunk)`` keeps what
    they noted: the chosen experts ``[tokens, L_chunk, k]`` when recording, the ``changed``
    flags ``[tokens, L_chunk]`` when replaying; ``of_micro_batch(i)`` joins the chunks' notes of
    micro-batch ``i`` along ``L``; ``finish()`` disarms every router."""

    def __init__(self, models: list[torch.nn.Module], replaying: bool) -> None:
        self.models = models
        self.replaying = replaying
        self.replays = {id(chunk): routers_of(chunk) for chunk in models}
        self.noted: dict[int, list[torch.Tensor]] = {id(chunk): [] for chunk in models}
        # where each chunk's MoE layers start along L (the earlier chunks' come first)
        self.first_layer: dict[int, int] = {}
        count = 0
        for chunk in models:
            self.first_layer[id(chunk)] = count
            count += len(self.replays[id(chunk)])

    def before(self, chunk: torch.nn.Module, routing: torch.Tensor | None) -> None:
        start = self.first_layer[id(chunk)]
        for layer, replay in enumerate(self.replays[id(chunk)]):
            replay.clear_indices()
            replay.changed = None
            if not self.replaying:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            elif routing is None:
                raise ValueError("routing replay: a micro-batch of this call carries no routing")
            else:
                replay.set_target_indices(routing[:, start + layer])
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after(self, chunk: torch.nn.Module) -> None:
        replays = self.replays[id(chunk)]
        if not replays:
            return
        if self.replaying:
            noted = torch.stack([r.changed for r in replays], dim=1)
        else:
            noted = torch.stack([r.get_recorded_indices() for r in replays], dim=1)
            noted = noted.to(torch.int16)
        self.noted[id(chunk)].append(noted.detach())

    def of_micro_batch(self, index: int) -> torch.Tensor | None:
        parts = [self.noted[id(chunk)][index] for chunk in self.models if self.noted[id(chunk)]]
        return torch.cat(parts, dim=1) if parts else None

    def finish(self) -> None:
        for replays in self.replays.values():
            for replay in replays:
                replay.clear_router_replay_action()
                replay.clear_indices()
                replay.changed = None


def routing_pass(
    models: list[torch.nn.Module], mesh: Mesh, micro_batches: list[MicroBatch], record: bool
) -> RoutingPass | None:
    """The call's routing recording or replay (``parallel.routing_replay``), None for neither."""
    replay = micro_batches[0].routing is not None
    if not (record or replay):
        return None
    config = get_model_config(models[0])
    if getattr(config, "sequence_parallel", False):
        raise ValueError(
            "MoE routing replay with sequence parallelism is not supported: each tensor-parallel "
            "rank routes its own slice of the tokens"
        )
    if mesh.pp > 1 and getattr(config, "recompute_granularity", None) is not None:
        raise ValueError(
            "MoE routing replay with pipeline parallelism needs activation recomputation off: a "
            "recomputed forward would replay a later micro-batch's experts"
        )
    return RoutingPass(models, replaying=replay)


def attach_routing(
    results: list[MicroBatchResult],
    routing: RoutingPass,
    micro_batches: list[MicroBatch],
    padded: list[ModelInputs],
) -> None:
    """This rank's recorded routing (or replay's changed share) per micro-batch, per row."""
    for index, (result, mb) in enumerate(zip(results, micro_batches, strict=True)):
        per_token = routing.of_micro_batch(index)
        if per_token is None:  # no MoE layer on this rank
            continue
        per_row = padded[index].per_row(per_token, mb.input_ids.shape[1]).cpu()
        if routing.replaying:
            # tokens with a recorded choice (-1: one the recording never read)
            known = mb.attention_mask.bool() & (mb.routing >= 0).all(dim=-1).all(dim=-1)
            real = known[:, :, None].expand_as(per_row)
            result.routing_changed = torch.stack(
                [per_row[real].sum().double(), torch.tensor(float(real.sum()), dtype=torch.float64)]
            )
        else:
            result.routing = per_row
