"""Run under torchrun with 2 CPU processes. Used by test_routing_replay.py.

    routing_replay_worker.py HF_DIR OUT_JSON

A tiny Qwen2-MoE (8 experts, top-2, layer 1 dense) at DP2 (each rank its own rows) and at PP2
(two MoE layers on one stage, one on the other), padded and packed micro-batches. Per layout:
1. record the routing of a no-grad pass (micro-batches of 2 rows) with weights W0;
2. move the routers (W1) so that some tokens choose other experts: a free pass records them;
3. replay W0's routing under W1 in micro-batches cut differently (3 rows, or a token budget):
   forward hooks on megatron's routers read the experts they handed the dispatcher, laid out
   per row by hand (megatron's [S, mb] order flattened, or the packed row's real tokens);
4. replay W1's own routing: the log-probs must equal the free pass's;
5. one training step replaying W0's routing: the routers still get a gradient.
Each rank writes its numbers; rank 0 gathers them into OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from parallel.forward_passes import forward_log_probs, forward_log_probs_and_routing
from parallel.hf_model import load_hf_model
from parallel.mesh import init_parallel
from parallel.micro_batches import micro_batches
from parallel.model_options import ModelBuildOptions, MoeOptions
from parallel.schedule import forward_backward
from parallel.step_types import LossReport, MicroBatch
from rlcli.process_lifetime import exit_skipping_teardown

LAYOUTS = {"dp2": 1, "pp2": 2}
ROWS, SEQ, VOCAB = 6, 14, 251


def rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)
    lengths = torch.tensor([14, 9, 12, 5, 14, 7])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def routers(models) -> list[TopKRouter]:
    return [m for chunk in models for m in chunk.modules() if isinstance(m, TopKRouter)]


def hand_laid_out(routing_map: torch.Tensor, mb: MicroBatch, packed: bool) -> torch.Tensor:
    """The router's ``[tokens, E]`` choices as ``[mb rows, S, E]`` (0 where a row has no token):
    written here from megatron's layouts, apart from parallel.model_inputs."""
    n, length = mb.input_ids.shape
    out = torch.zeros(n, length, routing_map.shape[1], dtype=torch.bool)
    real = mb.attention_mask.bool()
    if packed:
        out[real] = routing_map[: int(real.sum())]
    else:
        padded_length = routing_map.shape[0] // n
        out[:] = routing_map.reshape(padded_length, n, -1).transpose(0, 1)[:, :length]
    return out


def one_hot(routing: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(*routing.shape[:-1], experts, dtype=torch.bool).scatter(
        -1, routing.long(), True
    )


def run_layout(hf_dir: str, pp: int, pack: bool) -> dict:
    mesh = init_parallel(tp=1, pp=pp, seed=3)
    options = ModelBuildOptions(moe=MoeOptions(routing_replay=True), pack_sequences=pack)
    models = load_hf_model(hf_dir, mesh, options=options)
    ids, mask = rows(seed=10 + mesh.dp_rank)
    budget = dict(max_tokens=30 * pack, pack_sequences=pack)
    # 1. W0's routing
    lp0, notes0 = forward_log_probs_and_routing(models, mesh, ids, mask, 2, **budget)
    routing0 = notes0.recorded
    experts = routers(models)[0].config.num_moe_experts
    # 2. W1: the routers moved
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in routers(models):
            router.weight += 0.1 * torch.randn(router.weight.shape, generator=generator)
    lp1, notes1 = forward_log_probs_and_routing(models, mesh, ids, mask, 2, **budget)
    routing1 = notes1.recorded
    real = mask.bool()[:, :, None].expand(*routing0.shape[:3])
    flipped = (routing0.sort(-1).values != routing1.sort(-1).values).any(-1)[real]
    # 3. replay W0 under W1, cut differently; the routers' own outputs, per row by hand
    seen: list[torch.Tensor] = []
    hooks = [
        r.register_forward_hook(lambda module, inputs, outputs: seen.append(outputs[1].cpu()))
        for r in routers(models)
    ]
    batch = MicroBatch(input_ids=ids, attention_mask=mask, routing=routing0)
    chunks = micro_batches(batch, 3, equal_sizes=pp > 1, max_tokens=30 * pack, pack=pack)
    results = forward_backward(models, mesh, chunks, None, forward_only=True, pack_sequences=pack)
    for hook in hooks:
        hook.remove()
    layers = len(routers(models))
    assert len(seen) == layers * len(chunks), (len(seen), layers, len(chunks))
    replay_mismatch = 0
    for index, mb in enumerate(chunks):
        for layer in range(layers):
            used = hand_laid_out(seen[index * layers + layer], mb, pack)
            wanted = one_hot(mb.routing[:, :, layer], experts)
            replay_mismatch += int((used != wanted).any(-1)[mb.attention_mask.bool()].sum())
    changed = torch.stack([r.routing_changed for r in results]).sum(0)
    # 4. replaying W1's own routing gives the free pass's log-probs
    own = MicroBatch(
        input_ids=ids, attention_mask=mask, routing=routing1, row_index=torch.arange(ROWS)
    )
    own_chunks = micro_batches(own, 3, equal_sizes=pp > 1, max_tokens=30 * pack, pack=pack)
    own_results = forward_backward(
        models, mesh, own_chunks, None, forward_only=True, pack_sequences=pack
    )
    replayed_lp = torch.zeros_like(lp1)
    for mb, result in zip(own_chunks, own_results, strict=True):
        width = result.outputs.log_probs.shape[1]
        replayed_lp[mb.row_index, :width] = result.outputs.log_probs
    label_mask = mask[:, 1:].bool()
    own_diff = float((replayed_lp - lp1).abs()[label_mask].max())
    w0_replay_lp = forward_log_probs(models, mesh, ids, mask, 2, **budget)  # free, W1 again
    # 5. a training forward/backward replaying W0: the routers still learn
    for chunk in models:
        chunk.zero_grad()

    def loss_fn(outputs, mb):
        return (outputs.log_probs * mb.attention_mask[:, 1:]).sum(), LossReport()

    train_chunks = micro_batches(batch, 2, equal_sizes=pp > 1, max_tokens=30 * pack, pack=pack)
    forward_backward(models, mesh, train_chunks, loss_fn, forward_only=False, pack_sequences=pack)
    router_grad = max(
        float(r.weight.grad.abs().max()) if r.weight.grad is not None else 0.0
        for r in routers(models)
    )
    parallel_state.destroy_model_parallel()
    return {
        "rank": dist.get_rank(),
        "layers": layers,
        "routing_shape": list(routing0.shape),
        "flipped_share": float(flipped.float().mean()),
        "replay_mismatch": replay_mismatch,
        "changed_share": float(changed[0] / changed[1]),
        "own_replay_logprob_diff": own_diff,
        "w1_free_vs_free_again": float((w0_replay_lp - lp1).abs()[label_mask].max()),
        "w0_vs_w1_logprob_diff": float((lp0 - lp1).abs()[label_mask].max()),
        "router_grad": router_grad,
    }


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    result = {}
    for name, pp in LAYOUTS.items():
        for pack in (False, True):
            row = run_layout(hf_dir, pp, pack)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, row)
            result[f"{name}-{'packed' if pack else 'padded'}"] = gathered
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
