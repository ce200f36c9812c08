"""Weight-sync benchmark: Megatron -> rollout engine, bucketed resharder vs. naive vs. memcpy.

For a random Qwen2-shaped model (default ~57M parameters) it times, on every rank, best of
`--repeats`:
  memcpy         one in-memory copy of the same bytes (the physical floor on one machine)
  buckets        `iter_inference_buckets` alone: gather + broadcast + HF split, no engine
  bucketed sync  `sync_weights` into the engine (what the trainer runs)
  naive sync     `iter_hf_weights` + one `load_weights` call per tensor (the simple path; with
                 vLLM this even breaks fused layers, so the model is re-synced afterwards)
  engine reload  vLLM's own in-place `reload_weights` of the same full HF tensors, already in
                 local memory (what the engine's load costs without any gather; vllm only)
and prints a table on rank 0; `--json PATH` writes the same numbers.

    python benchmarks/sync_bench.py [--engine vllm|hf] [--json out.json]
    torchrun --nproc_per_node 2 benchmarks/sync_bench.py --tp 2        (or --pp 2)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="training tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="training pipeline parallel size")
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--bucket-mb", type=float, default=0, help="0: automatic")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    return parser.parse_args()


def make_random_qwen2(args: argparse.Namespace, out_dir: str) -> int:
    """Save a random fp32 Qwen2 of the requested shape; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(out_dir, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    args = parse_args()
    from parallel import cpu_compat
    from parallel.convert import iter_hf_weights
    from parallel.hf_model import load_hf_model
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.reshard import iter_inference_buckets, sync_weights
    from rlcli.config.schema import RolloutConfig
    from rlcli.rollout import make_engine

    mesh = init_parallel(tp=args.tp, pp=args.pp, seed=0)
    shared = [tempfile.mkdtemp(prefix="sync_bench_") if mesh.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    model_dir = shared[0]
    num_params = [make_random_qwen2(args, model_dir) if mesh.rank == 0 else 0]
    dist.broadcast_object_list(num_params, src=0)

    models = load_hf_model(model_dir, mesh)
    rollout = RolloutConfig(
        engine=args.engine, tp=args.rollout_tp, kv_cache_gb=0.05, load_format="auto"
    )
    engine = make_engine(rollout, model_dir, max_model_len=128)

    num_bytes = sum(
        t.numel() * t.element_size()
        for b in iter_inference_buckets(models, mesh, 1e9)
        for _, t in b
    )

    def buckets_alone() -> None:
        with cpu_compat.suspended():  # as sync_weights runs it
            for _ in iter_inference_buckets(models, mesh, args.bucket_mb):
                pass

    source = torch.randn(num_bytes // 4)
    target = torch.empty_like(source)
    rows = {
        "memcpy": best_time(lambda: target.copy_(source), args.repeats),
        "buckets (no engine)": best_time(buckets_alone, args.repeats),
        "bucketed sync": best_time(
            lambda: sync_weights(models, mesh, engine, args.bucket_mb), args.repeats
        ),
        "naive sync": best_time(
            lambda: [engine.load_weights([item]) for item in iter_hf_weights(models, mesh)],
            args.repeats,
        ),
    }
    if args.engine == "vllm":
        full = [item for bucket in iter_inference_buckets(models, mesh, 1e9) for item in bucket]

        def engine_reload() -> None:
            # The engine's private LLM: the same RPC its load_weights makes, minus our glue, and
            # outside the CPU device mode as sync_weights runs it.
            with cpu_compat.suspended():
                engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": full})

        rows["engine reload"] = best_time(engine_reload, args.repeats)
    stats = sync_weights(models, mesh, engine, args.bucket_mb)  # leave the engine correct
    result = {
        "model_params": num_params[0],
        "bytes": num_bytes,
        "layout": {"tp": args.tp, "pp": args.pp, "dp": mesh.dp, "rollout_tp": args.rollout_tp},
        "engine": args.engine,
        "bucket_mb": args.bucket_mb,
        "num_buckets": stats.num_buckets,
        "rows": [
            {"method": name, "seconds": seconds, "gbps": num_bytes / seconds / 1e9}
            for name, seconds in rows.items()
        ],
    }
    if mesh.rank == 0:
        print(
            f"weight sync: {num_params[0] / 1e6:.1f}M params, {num_bytes / 2**20:.1f} MiB, "
            f"tp={args.tp} pp={args.pp} dp={mesh.dp} -> {args.engine} rollout_tp="
            f"{args.rollout_tp}, {stats.num_buckets} buckets of <= {args.bucket_mb} MiB"
        )
        print(f"{'method':<22}{'seconds':>10}{'GB/s':>10}")
        for row in result["rows"]:
            print(f"{row['method']:<22}{row['seconds']:>10.4f}{row['gbps']:>10.2f}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
    engine.close()
    destroy_parallel()
    if mesh.rank == 0:
        for path in Path(model_dir).iterdir():
            path.unlink()
        os.rmdir(model_dir)


if __name__ == "__main__":
    main()
