"""GPU probe (not a pytest test): measured memory per phase and offload / onload speed of a
Qwen2.5-0.5B / 1.5B-shaped megatron model on one GPU, next to parallel.memory_terms' estimate.

    torchrun --nproc_per_node=1 tests/parallel/memory_probe.py [qwen2.5-0.5b qwen2.5-1.5b]

Random bf16 weights (no checkpoint needed), TP1, plain optimizer, megatron's local layer spec
with torch SDPA as core attention (the plan's attention="sdpa"). Prints one line
per model and phase: measured peak bytes (torch.cuda.max_memory_allocated), the plan's bytes and
their ratio; offload / onload seconds against the pinned-copy floor (the same bytes in one pinned
host <-> device copy). On CPU it runs the same steps and prints the plan and transfer times only.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from transformers import Qwen2Config

from parallel.memory_terms import (
    TrainedModel,
    activation_bytes,
    forward_only_bytes,
    grad_bytes,
    optimizer_bytes,
    weight_bytes,
)
from parallel.mesh import init_parallel
from parallel.model import build_model
from parallel.model_options import ModelBuildOptions
from parallel.model_shapes import KNOWN_SHAPES, ModelShape
from parallel.offload import Offloader
from parallel.optim import OptimizerSettings, build_optimizer, train_step, wrap_for_training
from parallel.step_types import LossReport, MicroBatch, ModelOutputs
from rlcli.process_lifetime import exit_skipping_teardown

MICRO_BATCH = int(os.environ.get("PROBE_MICRO_BATCH", 4))
SEQ = int(os.environ.get("PROBE_SEQ", 1024))
MICRO_BATCHES = 2
CUDA = torch.cuda.is_available()
# "tiny" (tests' shape) lets the probe itself be tried on CPU
SHAPES = {**KNOWN_SHAPES, "tiny": ModelShape(64, 4, 4, 2, 16, 96, 251, False, True)}


def device_bytes(offloader: Offloader, kind: str) -> int:
    """Bytes ``kind`` holds on the device now (0 while offloaded)."""
    if offloader.is_offloaded(kind):
        return 0
    return sum(storage.nbytes() for storage in offloader._storages(kind))


def hf_config(name: str) -> Qwen2Config:
    s = SHAPES[name]
    return Qwen2Config(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.ffn,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied,
        max_position_embeddings=SEQ,
    )


def peak_of(fn) -> tuple[int, object]:
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result = fn()
    return (torch.cuda.max_memory_allocated() if CUDA else 0), result


def pinned_floor(nbytes: int) -> tuple[float, float]:
    """Seconds for one host -> device and one device -> host copy of nbytes, pinned."""
    if not CUDA:
        return 0.0, 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del host, dev
    return times[0], times[1]


def loss_fn(outputs: ModelOutputs, micro_batch: MicroBatch):
    return -outputs.log_probs.sum() / outputs.log_probs.numel(), LossReport()


def probe(name: str, mesh) -> None:
    torch.manual_seed(0)
    models = build_model(
        hf_config(name),
        mesh,
        dtype=torch.bfloat16,
        options=ModelBuildOptions(transformer_impl="local", attention_backend="sdpa"),
    )
    models = wrap_for_training(models, mesh)
    optimizer, scheduler = build_optimizer(models, OptimizerSettings(lr=1e-5, total_steps=10))
    plan = TrainedModel(
        SHAPES[name],
        dtype="bfloat16",
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ,
        num_micro_batches=MICRO_BATCHES,
        attention="sdpa",
    )
    vocab = SHAPES[name].vocab
    micro = [
        MicroBatch(
            input_ids=torch.randint(0, vocab, (MICRO_BATCH, SEQ), device=mesh_device()),
            attention_mask=torch.ones(MICRO_BATCH, SEQ, dtype=torch.long, device=mesh_device()),
        )
        for _ in range(MICRO_BATCHES)
    ]
    train_step(models, mesh, optimizer, scheduler, micro, loss_fn)  # Adam state now exists
    offloader = Offloader(models, optimizer)
    state = {k: device_bytes(offloader, k) for k in ("params", "grads", "optimizer")}
    planned_state = {
        "params": weight_bytes(plan),
        "grads": grad_bytes(plan),
        "optimizer": optimizer_bytes(plan),
    }
    for kind in state:
        report(name, f"{kind} bytes", state[kind], planned_state[kind])
    resident = sum(planned_state.values())
    peak, _ = peak_of(lambda: train_step(models, mesh, optimizer, scheduler, micro, loss_fn))
    report(name, "update peak", peak, resident + activation_bytes(plan))

    from parallel.schedule import forward_backward

    def forward() -> object:
        with torch.no_grad():
            return forward_backward(models, mesh, micro[:1], loss_fn, forward_only=True)

    peak, _ = peak_of(forward)
    report(name, "log-prob peak", peak, resident + forward_only_bytes(plan, MICRO_BATCH))

    before = torch.cuda.memory_allocated() if CUDA else 0
    out = offloader.offload(params=True, grads=True, optimizer=True)
    freed = before - (torch.cuda.memory_allocated() if CUDA else 0)
    back = offloader.onload(params=True, grads=True, optimizer=True)
    h2d, d2h = pinned_floor(out.bytes)
    print(
        f"PROBE {name} offload {out.bytes / 1e9:.2f} GB freed {freed / 1e9:.2f} GB in "
        f"{out.seconds:.3f} s (pinned floor {d2h:.3f} s); onload {back.seconds:.3f} s "
        f"(floor {h2d:.3f} s)",
        flush=True,
    )


def mesh_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


def report(name: str, what: str, measured: int, planned: int) -> None:
    ratio = measured / planned if planned and measured else float("nan")
    print(
        f"PROBE {name} {what}: measured {measured / 2**30:.3f} GiB, "
        f"plan {planned / 2**30:.3f} GiB, ratio {ratio:.3f}",
        flush=True,
    )


def main() -> None:
    mesh = init_parallel(tp=1, pp=1, seed=1)
    for name in sys.argv[1:] or ["qwen2.5-0.5b", "qwen2.5-1.5b"]:
        probe(name, mesh)  # its model and optimizer are freed on return
        if CUDA:
            torch.cuda.empty_cache()
    print("PROBE_OK", flush=True)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
