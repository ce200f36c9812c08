"""torchrun worker: Megatron (several TP x PP layouts in one launch) -> resharder -> colocated vLLM.

For each training layout: build the Megatron model from the HF checkpoint, perturb its weights
(as an optimizer step would), stream them into the rank's engine with `sync_weights`, sample,
and check that
  * the buckets hold exactly the tensors of the naive per-tensor export (`iter_hf_weights`) and
    never split a fused vLLM layer (q/k/v, gate/up, and all routed experts of a MoE layer);
  * vLLM's sampled-token log-probs equal Megatron's log-probs of the same sequences (fp32,
    max abs diff < 1e-3), for every rank's samples;
  * vLLM's greedy output equals the HF engine's greedy output on the same synced weights (rank 0).
Prints "RESHARD_OK tp=.. pp=.." per layout on rank 0.

usage: torchrun --nproc_per_node N reshard_engine_worker.py MODEL_DIR ROLLOUT_TP LAYOUT [LAYOUT..]
       LAYOUT is TPxPP[xEP[xETP]], e.g. 2x1, or 1x1x2 (MoE: experts over 2 EP ranks)
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file
from transformers import AutoConfig

from parallel.convert import iter_hf_weights, load_hf_weights, mesh_mappings
from parallel.forward_passes import forward_log_probs
from parallel.mesh import destroy_parallel, init_parallel
from parallel.model import build_model
from parallel.reshard import iter_inference_buckets, sync_weights
from rlcli.config.schema import RolloutConfig
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout import SamplingConfig, make_engine

TEMPERATURE = 0.8
PROMPTS = [[5, 17, 42, 7], [100, 3, 250], [9, 9, 9, 9, 9, 200]]
BUCKET_MB = 0.15  # several buckets per stage for this model, some holding several modules
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@torch.no_grad()
def perturb(models, hf_config, mesh) -> None:
    """Add noise seeded by HF name (and TP rank for split tensors): DP replicas and the TP copies
    of replicated tensors change identically, and a tied head copy like its embedding."""
    for m in mesh_mappings(models, hf_config, mesh):
        split_rank = mesh.etp_rank if m.expert else mesh.tp_rank
        seed = zlib.crc32(m.hf_names[0].encode()) + (
            split_rank if m.partition_dim is not None else 0
        )
        noise = torch.randn(m.param.shape, generator=torch.Generator().manual_seed(seed))
        m.param.add_(0.05 * noise.to(m.param.dtype))


class Tee:
    """Feeds each bucket to every engine given (vLLM, plus HF on rank 0) and keeps the names."""

    def __init__(self, *engines) -> None:
        self.engines = engines
        self.buckets: list[list[str]] = []

    def load_weights(self, bucket) -> None:
        self.buckets.append([name for name, _ in bucket])
        for engine in self.engines:
            engine.load_weights(bucket)


def check_buckets(models, mesh, reference: dict[str, torch.Tensor]) -> None:
    """Buckets == `reference` tensors exactly, within the size limit, fused layers whole."""
    seen = {}
    for bucket in iter_inference_buckets(models, mesh, BUCKET_MB):
        names = {name for name, _ in bucket}
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        # one module, e.g. ...self_attn, or a layer's routed experts
        layers = {
            name.partition(".experts.")[0] if ".experts." in name else name.rsplit(".", 2)[0]
            for name in names
        }
        assert size <= BUCKET_MB * 2**20 or len(layers) == 1, f"{size} bytes: {sorted(names)}"
        for name in names:
            for group in FUSED_GROUPS:
                for part in group:
                    if f".{part}." in name:
                        siblings = {name.replace(f".{part}.", f".{other}.") for other in group}
                        assert siblings <= names, f"bucket splits fused layer of {name}: {names}"
        for layer in {
            name.partition(".mlp.experts.")[0] for name in names if ".mlp.experts." in name
        }:
            experts = {n for n in reference if n.startswith(f"{layer}.mlp.experts.")}
            assert experts <= names, f"bucket splits the experts of {layer}"
        seen.update(bucket)
    assert seen.keys() == reference.keys(), sorted(seen.keys() ^ reference.keys())
    for name, tensor in reference.items():
        assert torch.equal(seen[name], tensor), name


def megatron_logprobs(models, mesh, sequences: list[list[int]]) -> torch.Tensor:
    """[len(sequences), S-1] log-probs at temperature TEMPERATURE (same batch on every rank)."""
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
    return forward_log_probs(models, mesh, input_ids, attention_mask, 8, TEMPERATURE).cpu()


def run_layout(model_dir, layout, engine, hf_engine, replica_index) -> None:
    tp, pp, ep, etp = layout + (1, None)[len(layout) - 2 :]
    mesh = init_parallel(tp=tp, pp=pp, seed=1234, ep=ep, etp=etp)
    hf_config = AutoConfig.from_pretrained(model_dir)
    models = build_model(hf_config, mesh)
    for model in models:
        model.eval()  # megatron's MoE layer refuses to train at TP > 1 without SP
    load_hf_weights(models, mesh, model_dir)
    check_buckets(models, mesh, load_file(f"{model_dir}/model.safetensors"))
    perturb(models, hf_config, mesh)
    check_buckets(models, mesh, dict(iter_hf_weights(models, mesh)))

    tee = Tee(engine, *([hf_engine] if hf_engine else []))
    stats = sync_weights(models, mesh, tee, BUCKET_MB)
    assert stats.num_buckets == len(tee.buckets) > 2 and stats.bytes > 0

    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=12, seed=7)
    samples = [
        (prompt, c.token_ids, c.logprobs)
        for prompt, completions in zip(PROMPTS, engine.generate(PROMPTS, 2, sampling), strict=True)
        for c in completions
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (replica_index, samples))
    replicas = {index: rank_samples for index, rank_samples in everyone}
    if len(replicas) > 1:  # replicas' seeds are spaced: they must not repeat each other
        distinct = {tuple(tuple(s[1]) for s in rank_samples) for rank_samples in replicas.values()}
        assert len(distinct) == len(replicas), "replicas drew identical samples"
    all_samples = [s for index in sorted(replicas) for s in replicas[index]]
    trainer = megatron_logprobs(models, mesh, [p + c for p, c, _ in all_samples])
    worst = 0.0
    for row, (prompt, completion, engine_log_probs) in enumerate(all_samples):
        start = len(prompt) - 1
        expected = trainer[row, start : start + len(completion)]
        worst = max(worst, (torch.tensor(engine_log_probs) - expected).abs().max().item())
    assert worst < 1e-3, f"{layout}: engine vs Megatron log-prob diff {worst}"

    greedy = SamplingConfig(temperature=0, max_tokens=12)
    vllm_greedy = [c[0].token_ids for c in engine.generate(PROMPTS, 1, greedy)]  # collective
    if hf_engine is not None:
        hf_greedy = [c[0].token_ids for c in hf_engine.generate(PROMPTS, 1, greedy)]
        assert vllm_greedy == hf_greedy, (vllm_greedy, hf_greedy)
    if mesh.rank == 0:
        print(
            f"RESHARD_OK tp={tp} pp={pp} ep={mesh.ep} etp={mesh.etp} dp={mesh.dp} "
            f"max_diff={worst:.2e} "
            f"buckets={stats.num_buckets} bytes={stats.bytes} seconds={stats.seconds:.4f}",
            flush=True,
        )
    parallel_state.destroy_model_parallel()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` shows a hang
    model_dir, rollout_tp, *layouts = sys.argv[1:]
    rollout_tp = int(rollout_tp)
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in layouts]
    mesh = init_parallel(tp=layouts[0][0], pp=layouts[0][1], seed=1234)  # the process group
    parallel_state.destroy_model_parallel()
    section = RolloutConfig(engine="vllm", tp=rollout_tp, kv_cache_gb=0.03, load_format="auto")
    engine = make_engine(section, model_dir, max_model_len=64)
    hf_engine = make_engine(RolloutConfig(engine="hf"), model_dir) if mesh.rank == 0 else None
    for layout in layouts:
        run_layout(model_dir, layout, engine, hf_engine, engine.replica.index)
    engine.close()
    destroy_parallel()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
