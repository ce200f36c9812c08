"""Checks 4 and 5: the CLI end to end in bf16 with an automatic resume, and actor throughput
(with the layers and attention auto resolves to; check 7 compares the attentions)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import torch

from tests.gpu.common import REPO_ROOT_ENV, Context, make_actor, step, synchronize, token_batch

# Qwen2-0.5B and Qwen2-1.5B shapes (config.json of the released models); weights random.
QWEN2_SHAPES = {
    "Qwen2-0.5B": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen2-1.5B": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=251,
    tie_word_embeddings=True,
)


def _run_cli(ctx: Context, steps: int, output_dir: str, timeout_s: int) -> tuple[int, str, float]:
    overrides = [
        f"trainer.output_dir={output_dir}",
        "model.dtype=bfloat16",
        f"rollout.engine={ctx.engine}",
        f"trainer.total_steps={steps}",
        "trainer.val_freq=0",
        "trainer.val_before_train=false",
        "checkpoint.save_freq=2",
        "sft.steps=30",
        "rollout.n=4",
        "actor.pack_sequences=true",  # the packed path through the whole trainer
        "logging.backends=[console,jsonl]",
    ]
    cmd = [sys.executable, "-m", "rlcli.cli", "train", "recipes/quickstart.yaml", *overrides]
    path = os.pathsep.join(filter(None, [REPO_ROOT_ENV, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the child builds its own world, not this process's
    start = time.perf_counter()
    # Own session: on a timeout the whole tree goes (the CLI's own children too).
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT_ENV,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, f"(killed after {timeout_s} s) {out}", time.perf_counter() - start
    return proc.returncode, out, time.perf_counter() - start


def check_cli_train_resume(ctx: Context) -> tuple[bool, str]:
    """`rlcli train recipes/quickstart.yaml` in bf16 with packed sequences for 4 steps
    (checkpoint at 2 and 4), then the same command to 6 steps: it must resume from step 4 by
    itself."""
    output_dir = str(ctx.work / "quickstart")
    code, out, first_s = _run_cli(ctx, 4, output_dir, timeout_s=110)
    if code != 0:
        return False, f"first run exited {code} after {first_s:.0f} s: ...{out[-1500:]}"
    code, out2, second_s = _run_cli(ctx, 6, output_dir, timeout_s=80)
    if code != 0:
        return False, f"resumed run exited {code} after {second_s:.0f} s: ...{out2[-1500:]}"
    resumed = re.search(r"resumed from step (\d+)", out2)
    ok = resumed is not None and resumed.group(1) == "4"
    return ok, (
        f"4 steps in {first_s:.0f} s, then "
        + (f"resumed from step {resumed.group(1)}" if resumed else "NO RESUME MESSAGE")
        + f" and ran to step 6 in {second_s:.0f} s"
    )


def flops_per_token(shape: dict, seq_len: int) -> float:
    """fwd + bwd model FLOPs per token: 6 x matmul parameters (LM head included) plus causal
    attention scores and values, 6 x layers x seq_len x hidden (half of the full 12)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * shape["intermediate_size"]
    matmul_params = layers * per_layer + shape["vocab_size"] * h
    return 6 * matmul_params + 6 * layers * seq_len * h


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    from benchmarks.hardware import peak_bf16_flops

    return peak_bf16_flops(torch.cuda.get_device_name(0))


class _CopyingConsumer:
    """Takes weight buckets as an engine does: copies each tensor into its own preallocated
    destination (allocated on first sight, outside the timed second sync)."""

    def __init__(self) -> None:
        self.targets: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            target = self.targets.get(name)
            if target is None:
                target = self.targets[name] = torch.empty_like(tensor)
            target.copy_(tensor)


def _sync_numbers(ctx: Context, actor) -> str:
    from parallel.reshard import sync_weights
    from tests.gpu.checks_engine import copy_floor_gbps

    consumer = _CopyingConsumer()
    sync_weights(actor.models, ctx.mesh, consumer, bucket_mb=512)  # allocates the targets
    stats = sync_weights(actor.models, ctx.mesh, consumer, bucket_mb=512)
    floor = copy_floor_gbps(stats.bytes)
    return (
        f"sync {stats.bytes / 1e9:.2f} GB in {stats.seconds * 1e3:.0f} ms = {stats.gbps:.0f} "
        f"GB/s ({stats.gbps / floor * 100:.0f}% of the {floor:.0f} GB/s copy floor)"
    )


def check_throughput(ctx: Context) -> tuple[bool, str]:
    """fwd + bwd + AdamW (distributed optimizer, bf16, fp32 master) on 8 x 1024 tokens of random
    ids, random weights; tokens/s and MFU against the data-sheet bf16 peak. Also the weight
    sync of the same model (512 MB buckets) into a consumer that copies every tensor, in GB/s
    against one device copy of the same bytes."""
    from transformers import Qwen2Config

    from parallel.model_backends import resolve_backends

    backends = resolve_backends()  # what a run's auto settings build here
    impl = f"{backends.transformer_impl} layers, {backends.attention} attention"
    shapes = {"tiny (dry run)": TINY_SHAPE} if ctx.cpu else QWEN2_SHAPES
    rows, seq_len = (4, 64) if ctx.cpu else (8, 1024)
    peak = peak_flops()
    parts, ok = [f"{impl}, {rows}x{seq_len} tokens, 2 micro-batches"], True
    for name, shape in shapes.items():
        config = Qwen2Config(
            **shape,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        actor = make_actor(
            ctx,
            config,
            model_dir=None,
            distributed_optimizer=True,
            lr=1e-5,
            transformer_impl=backends.transformer_impl,
            attention_backend=backends.attention,
        )
        batch = token_batch(ctx, shape["vocab_size"], rows, seq_len, micro=rows // 2)
        losses = [step(ctx, actor, batch) for _ in range(2)]  # warm-up
        synchronize()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        timed_steps = 3
        for _ in range(timed_steps):
            losses.append(step(ctx, actor, batch))
        synchronize()
        seconds = (time.perf_counter() - start) / timed_steps
        tokens_per_s = rows * seq_len / seconds
        flops = flops_per_token(shape, seq_len) * tokens_per_s
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0
        finite = all(loss == loss for loss in losses)
        ok = ok and finite
        mfu = f", MFU {flops / peak * 100:.1f}%" if peak else ""
        parts.append(
            f"{name}: {tokens_per_s:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s{mfu}, "
            f"{seconds * 1e3:.0f} ms/step, peak {peak_gb:.1f} GB"
            + ("" if finite else ", NON-FINITE LOSS")
            + f"; {_sync_numbers(ctx, actor)}"
        )
        del actor, batch
        ctx.release_memory()
    return ok, "; ".join(parts)
