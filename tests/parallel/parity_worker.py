"""torchrun worker for test_convert_parity.py: many checks per launch, one launch per layout.

    torchrun --nproc_per_node N tests/parallel/parity_worker.py --tp T --pp P [--vpp V]
        [--ep E --etp T2] --models DIR[,DIR...] --result FILE.json --export-dir DIR
    torchrun --nproc_per_node N tests/parallel/parity_worker.py --plan FILE.json

``--plan``: a JSON list of layouts (each the options above as keys: tp, pp, vpp, ep, etp,
models, result, export_dir) checked one after the other in one launch, on the same process
group: megatron's parallel state is torn down and set up again (and the RNGs seeded again)
between layouts, so each layout sees what a launch of its own would.

For each HF model directory: build the Megatron chunks, load the HF weights, run a forward
through megatron's pipeline schedule and compare the (TP-gathered, unpadded) logits with HF
transformers; gather the weights back with iter_hf_weights and compare them bit-exactly with the
safetensors on disk (on every rank; a zero-centred norm, held as 1 + w, up to that addition's
rounding); for the first model also write them with
save_hf_checkpoint and compare the written file. Before loading, DP replicas must hold equal
random weights (routed experts: the replicas of each expert). For MoE models, every Megatron
router of this rank must choose the same top-k experts for every token as HF's router of that
layer, and (TP1 x PP1) `parallel.moe.router_load_metrics` must report the load and the aux
loss that HF's choices and probabilities give. `rlcli plan`'s counts (parallel.model_shapes, parallel.memory_terms) must equal the
rank's real parameters (routed experts apart) and the busiest rank's weight bytes. Rank 0
writes the numbers to --result; failures are reported there too.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.parallel_state import get_expert_data_parallel_group as expert_dp_group
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from parallel.convert import iter_hf_weights, load_hf_weights, save_hf_checkpoint
from parallel.memory_terms import TrainedModel, weight_bytes
from parallel.mesh import Mesh, destroy_parallel, init_parallel
from parallel.model import build_model
from parallel.model_backends import transformer_engine_status
from parallel.model_options import ModelBuildOptions, MoeOptions
from parallel.model_shapes import ModelShape, stage_expert_params, stage_params
from parallel.moe import is_moe
from parallel.parity import round_trip_equal
from rlcli.process_lifetime import exit_skipping_teardown
from tests.parallel.moe_checks import (
    hf_router_choices,
    megatron_router_choices_equal,
    router_metrics_match,
)

BATCH, SEQ = 2, 12
# Qwen2-MoE runs megatron's all-gather token dispatcher, Qwen3-MoE the default all-to-all.
MOE_OPTIONS = {"qwen2_moe": MoeOptions(token_dispatcher="allgather")}


def _tokens(vocab: int, dp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of its own for each data-parallel rank (MoE: uneven all-to-all splits)."""
    generator = torch.Generator().manual_seed(7 + dp_rank)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ).contiguous()


def _last_stage_output(models, mesh: Mesh, tokens, positions) -> torch.Tensor | None:
    """The post_process chunk's output (through megatron's schedule), None off the last stage."""

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    num_microbatches = mesh.pp if mesh.vpp else 1  # interleaving wants a multiple of pp
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(())] * len(models) if mesh.vpp else iter(()),
        model=models,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=True,
    )
    return results[0]["logits"] if mesh.is_last_stage else None


def _megatron_logits(models, mesh: Mesh, tokens, positions, vocab: int) -> torch.Tensor | None:
    """Full-vocab logits [b, s, V] on last-stage ranks, None elsewhere."""
    local = _last_stage_output(models, mesh, tokens, positions)  # [b, s, Vp/tp]
    if local is None:
        return None
    shards = [torch.empty_like(local) for _ in range(mesh.tp)]
    dist.all_gather(shards, local.contiguous(), group=mesh.tp_group)
    return torch.cat(shards, dim=-1)[..., :vocab]


def _dp_replicas_equal(models, mesh: Mesh) -> bool:
    """Dense weights equal over the DP group; routed experts (megatron marks them allreduce=
    False) over the expert-DP group, the ranks holding the same experts."""
    params = [p for m in models for p in m.parameters()]
    equal = True
    for expert, group in ((False, mesh.dp_group), (True, expert_dp_group())):
        chosen = [
            p.detach().flatten() for p in params if (not getattr(p, "allreduce", True)) == expert
        ]
        if not chosen:
            continue
        flat = torch.cat(chosen)
        copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, flat, group=group)
        equal &= all(torch.equal(copies[0], c) for c in copies)
    return equal


def _plan_counts(models, mesh: Mesh, hf_dir: Path) -> dict:
    """rlcli plan's parameter counts for this rank vs the real model's; weight bytes of the
    busiest rank (fp32) vs the plan's."""
    shape = ModelShape.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    params = {
        (i, name): p.numel() for i, m in enumerate(models) for name, p in m.named_parameters()
    }
    experts = sum(n for (_, name), n in params.items() if ".mlp.experts." in name)
    real = (sum(params.values()), experts)
    layout = dict(pp=mesh.pp, pp_rank=mesh.pp_rank, ep=mesh.ep, etp=mesh.etp)
    planned = (stage_params(shape, tp=mesh.tp, **layout), stage_expert_params(shape, **layout))
    busiest = torch.tensor([real[0]])
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    trained = TrainedModel(shape, "float32", mesh.tp, mesh.pp, dp=mesh.dp, ep=mesh.ep, etp=mesh.etp)
    return {
        "params_real_planned": [real, planned],  # rank 0's (total, routed experts)
        "plan_counts_match": _all_true(real == planned),
        "plan_weight_bytes_match": weight_bytes(trained) == 4 * busiest.item(),
    }


def _all_true(flag: bool) -> bool:
    value = torch.tensor([0 if flag else 1])
    dist.all_reduce(value)
    return value.item() == 0


def check_model(hf_dir: Path, mesh: Mesh, export_dir: Path | None) -> dict:
    hf_config = AutoConfig.from_pretrained(hf_dir)
    moe = MOE_OPTIONS.get(hf_config.model_type, MoeOptions())
    models = build_model(hf_config, mesh, options=ModelBuildOptions(moe=moe))
    for model in models:
        model.eval()  # megatron's MoE layer refuses to train at TP > 1 without SP
    report = {"dp_replicas_equal": _all_true(_dp_replicas_equal(models, mesh))}
    report.update(_plan_counts(models, mesh, hf_dir))
    load_hf_weights(models, mesh, hf_dir)

    tokens, positions = _tokens(hf_config.vocab_size, mesh.dp_rank)
    logits = _megatron_logits(models, mesh, tokens, positions, hf_config.vocab_size)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    diff = None
    if mesh.is_last_stage:
        with torch.no_grad():
            reference = hf_model(tokens).logits
        diff = (logits - reference).abs().max().item()
    report["max_abs_logit_diff"] = mesh.broadcast_object_from_last_stage(diff)
    if is_moe(hf_config):
        forward = partial(_last_stage_output, models, mesh, tokens, positions)
        hf_routing = hf_router_choices(hf_model, tokens)  # all ranks: every rank routes
        routers_equal = megatron_router_choices_equal(models, positions, forward, hf_routing)
        report["router_choices_equal"] = _all_true(routers_equal)
        if mesh.tp == 1 and mesh.pp == 1:  # a training forward: MoE at TP > 1 needs SP
            report["router_metrics_match"] = _all_true(
                router_metrics_match(models, mesh, tokens, positions, hf_routing)
            )

    on_disk = load_file(hf_dir / "model.safetensors")
    gathered = {name: tensor.clone() for name, tensor in iter_hf_weights(models, mesh)}
    exact = gathered.keys() == on_disk.keys() and all(
        round_trip_equal(hf_config, n, gathered[n], on_disk[n]) for n in on_disk
    )
    report["round_trip_exact"] = _all_true(exact)
    report["round_trip_missing"] = sorted(on_disk.keys() - gathered.keys())
    report["round_trip_extra"] = sorted(gathered.keys() - on_disk.keys())

    if export_dir is not None:
        report["ddp_wrapped_round_trip_exact"] = _all_true(_ddp_round_trip(models, mesh, on_disk))
        report.update(_check_variants(hf_dir, hf_config, mesh, tokens, positions))
        save_hf_checkpoint(models, mesh, export_dir, hf_config)
        if mesh.rank == 0:
            written = load_file(export_dir / "model.safetensors")
            report["saved_exact"] = written.keys() == on_disk.keys() and all(
                round_trip_equal(hf_config, n, written[n], on_disk[n]) for n in on_disk
            )
            written_config = json.loads((export_dir / "config.json").read_text())
            report["saved_config_ok"] = written_config == json.loads(
                (hf_dir / "config.json").read_text()
            )
    return report


def _ddp_round_trip(models, mesh: Mesh, on_disk: dict) -> bool:
    """iter_hf_weights on megatron-DDP-wrapped chunks (as the trainer holds them)."""
    hf_config = models[0].hf_config
    wrapped = [
        DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk)
        for chunk in models
    ]
    gathered = {name: tensor.clone() for name, tensor in iter_hf_weights(wrapped, mesh)}
    return gathered.keys() == on_disk.keys() and all(
        round_trip_equal(hf_config, n, gathered[n], on_disk[n]) for n in on_disk
    )


def _check_variants(hf_dir: Path, hf_config, mesh: Mesh, tokens, positions) -> dict:
    """Critic values [b, s] vs HF final hidden states @ value head; sequence-parallel logits."""
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_hidden = hf_model.model(tokens).last_hidden_state  # [b, s, h], after the final norm
        hf_logits = hf_model(tokens).logits
    report = {}

    critic = build_model(hf_config, mesh, critic=True)
    for model in critic:
        model.eval()
    load_hf_weights(critic, mesh, hf_dir)
    values = _last_stage_output(critic, mesh, tokens, positions)
    diff = None
    if mesh.is_last_stage:
        head = critic[-1].output_layer.value
        expected = (hf_hidden @ head.weight.T + head.bias).squeeze(-1)
        diff = (values - expected).abs().max().item() if values.shape == expected.shape else 1e9
    report["critic_max_abs_value_diff"] = mesh.broadcast_object_from_last_stage(diff)
    report["critic_exports_score"] = sorted(
        name for name, _ in iter_hf_weights(critic, mesh) if not name.startswith("model.")
    )

    if mesh.tp > 1 and transformer_engine_status()[0]:  # the local spec cannot do SP
        sp_models = build_model(hf_config, mesh, options=ModelBuildOptions(sequence_parallel=True))
        load_hf_weights(sp_models, mesh, hf_dir)
        logits = _megatron_logits(sp_models, mesh, tokens, positions, hf_config.vocab_size)
        diff = (logits - hf_logits).abs().max().item() if logits is not None else None
        report["sequence_parallel_max_abs_logit_diff"] = mesh.broadcast_object_from_last_stage(diff)
    return report


def check_layout(layout: dict) -> None:
    """Every check of ``layout`` (keys: tp, pp, vpp, ep, etp, models, result, export_dir); rank 0
    writes the summary to ``layout["result"]``. Leaves megatron's parallel state torn down."""
    mesh = init_parallel(
        tp=layout["tp"], pp=layout["pp"], vpp=layout["vpp"], ep=layout["ep"], etp=layout["etp"]
    )
    reports = {}
    for index, hf_dir in enumerate(layout["models"].split(",")):
        export_dir = Path(layout["export_dir"]) if layout["export_dir"] and index == 0 else None
        reports[Path(hf_dir).name] = check_model(Path(hf_dir), mesh, export_dir)
    summary = {"layout": layout, "world_size": mesh.world_size, "dp": mesh.dp, **reports}
    summary["ep"], summary["etp"] = mesh.ep, mesh.etp
    if mesh.rank == 0:
        Path(layout["result"]).write_text(json.dumps(summary, indent=2))
    parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--models")
    parser.add_argument("--result")
    parser.add_argument("--export-dir", default=None)
    parser.add_argument("--plan", default=None)
    args = parser.parse_args()
    if args.plan is not None:
        layouts = json.loads(Path(args.plan).read_text())
    else:
        layouts = [{key: value for key, value in vars(args).items() if key != "plan"}]
    for layout in layouts:
        check_layout(layout)
    destroy_parallel()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
