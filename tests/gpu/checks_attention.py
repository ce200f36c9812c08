"""Checks 7 and 8: the core attentions and packed sequences (MFU, peak memory, the packed-row
kernel), and the first offload at the pinned-copy floor."""

from __future__ import annotations

import time

import torch

from tests.gpu.checks_perf import QWEN2_SHAPES, TINY_SHAPE, flops_per_token, peak_flops
from tests.gpu.common import Context, make_actor, step, synchronize, token_batch

# (model.attention_backend, actor.pack_sequences); TE's attention joins where TE imports
VARIANTS = [("local", False), ("sdpa", False), ("sdpa", True)]
LOSS_TOLERANCE = 0.02  # relative, bf16: every variant computes the same first loss
VARLEN_TOLERANCE = 2e-2  # bf16 flash kernel against per-sequence SDPA


def _variants() -> list[tuple[str, bool]]:
    from parallel.model_backends import transformer_engine_status

    return VARIANTS + ([("te", False), ("te", True)] if transformer_engine_status()[0] else [])


def _qwen2_config(shape: dict):
    from transformers import Qwen2Config

    return Qwen2Config(
        **shape,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


def _measure(ctx: Context, config, batch, attention: str, pack: bool) -> dict:
    """First loss, tokens/s over 3 timed steps after 2 warm-up steps, peak memory of a step."""
    impl = "transformer_engine" if attention == "te" else "local"
    actor = make_actor(
        ctx, config, model_dir=None, distributed_optimizer=True, lr=1e-5,
        transformer_impl=impl, attention_backend=attention, pack_sequences=pack,
    )  # fmt: skip
    losses = [step(ctx, actor, batch) for _ in range(2)]
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(3):
        losses.append(step(ctx, actor, batch))
    synchronize()
    seconds = (time.perf_counter() - start) / 3
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    del actor
    ctx.release_memory()
    tokens = sum(int(m.attention_mask.sum()) for m in batch)
    return {"first_loss": losses[0], "finite": all(x == x for x in losses),
            "tokens_per_s": tokens / seconds, "peak_gb": peak}  # fmt: skip


def check_attention_backends(ctx: Context) -> tuple[bool, str]:
    """fwd + bwd + AdamW (bf16, distributed optimizer) on 8 x 1024 tokens (4 x 64 on CPU) with
    megatron's unfused attention, sdpa, and sdpa on packed micro-batches (2 micro-batches of 4
    rows, each packed into one row): tokens/s, MFU, peak memory; every variant's first loss
    equal to the unfused one's. Then the packed-row kernel: on CUDA torch's varlen flash
    attention against per-sequence SDPA, on CPU the varlen call on meta tensors."""
    shapes = {"tiny (dry run)": TINY_SHAPE} if ctx.cpu else QWEN2_SHAPES
    rows, seq_len = (4, 64) if ctx.cpu else (8, 1024)
    peak = peak_flops()
    ok, parts = True, [f"{rows}x{seq_len} tokens, 2 micro-batches"]
    for name, shape in shapes.items():
        config = _qwen2_config(shape)
        batch = token_batch(ctx, shape["vocab_size"], rows, seq_len, micro=rows // 2)
        runs = {(a, p): _measure(ctx, config, batch, a, p) for a, p in _variants()}
        reference = runs[("local", False)]["first_loss"]
        cells = []
        for (attention, pack), run in runs.items():
            agrees = abs(run["first_loss"] - reference) <= LOSS_TOLERANCE * abs(reference)
            ok = ok and run["finite"] and agrees
            mfu = run["tokens_per_s"] * flops_per_token(shape, seq_len) / peak if peak else None
            cells.append(
                f"{attention}{' + packing' if pack else ''} {run['tokens_per_s']:,.0f} tokens/s"
                + (f", MFU {mfu * 100:.1f}%" if mfu is not None else "")
                + f", peak {run['peak_gb']:.1f} GB, loss {run['first_loss']:.4f}"
                + ("" if agrees and run["finite"] else " DIFFERS")
            )
        if torch.cuda.is_available():
            lower = runs[("sdpa", True)]["peak_gb"] < runs[("local", False)]["peak_gb"]
            ok = ok and lower
            cells.append(f"sdpa + packing peak {'below' if lower else 'NOT BELOW'} local's")
        parts.append(f"{name}: " + "; ".join(cells))
    kernel_ok, kernel = _packed_kernel_check(ctx)
    return ok and kernel_ok, "; ".join([*parts, kernel])


def _packed_kernel_check(ctx: Context) -> tuple[bool, str]:
    from parallel.attention import packed_attention, packed_attention_kernel
    from parallel.model_inputs import pack_rows

    lengths = [300, 17, 129, 64, 1]
    mask = (torch.arange(300)[None, :] < torch.tensor(lengths)[:, None]).long()
    packed = pack_rows(torch.ones(len(lengths), 300, dtype=torch.long), mask, length=520)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("meta")
    params = packed.params
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.to(device)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(packed.num_tokens, heads, 64, generator=generator).to(device, torch.bfloat16)
        for heads in (14, 2, 2)
    )
    for x in (q, k, v):
        x.requires_grad_()
    kernel = packed_attention_kernel(q)
    out = packed_attention(q, k, v, params, 0.125)
    out.float().square().sum().backward()
    shapes_ok = out.shape == q.shape and k.grad.shape == k.shape and kernel == "varlen"
    if device.type == "meta":
        return shapes_ok, f"packed-row kernel {kernel} on meta tensors: shapes and grads ok"
    # the same attention one sequence at a time (the CPU path), in float32
    per_sequence = packed_attention(q.float(), k.float(), v.float(), params, 0.125)
    diff = float((out.float() - per_sequence).abs().max())
    return shapes_ok and diff < VARLEN_TOLERANCE, (
        f"packed-row kernel {kernel} vs per-sequence SDPA max |diff| {diff:.1e} "
        f"(limit {VARLEN_TOLERANCE})"
    )


def check_first_offload(ctx: Context) -> tuple[bool, str]:
    """The actor's state offloaded at the pinned-copy floor from the first offload on: pinned
    buffers reserved at build (timed), one step (Adam state appears), then offload / onload
    twice; no offload may allocate, and on CUDA each is compared with one pinned copy of the
    same bytes."""
    from parallel.offload import Offloader

    shape = TINY_SHAPE if ctx.cpu else QWEN2_SHAPES["Qwen2-0.5B"]
    rows, seq_len = (4, 64) if ctx.cpu else (8, 1024)
    actor = make_actor(ctx, _qwen2_config(shape), model_dir=None, distributed_optimizer=True)
    offloader = Offloader(actor.models, actor.optimizer)
    reserved = offloader.reserve(params=True, grads=True, optimizer=True)
    step(ctx, actor, token_batch(ctx, shape["vocab_size"], rows, seq_len, micro=rows // 2))
    moves = []
    for _ in range(2):
        out = offloader.offload(params=True, grads=True, optimizer=True)
        back = offloader.onload(params=True, grads=True, optimizer=True)
        moves.append((out, back))
    floor = _pinned_copy_seconds(moves[0][0].bytes)
    ok = all(out.allocated_bytes == 0 for out, _ in moves) and moves[0][0].bytes > 0
    first, second = moves[0][0], moves[1][0]
    detail = (
        f"reserved {reserved.allocated_bytes / 1e9:.2f} GB pinned in "
        f"{reserved.allocation_seconds:.2f} s at build; first offload {first.bytes / 1e9:.2f} GB "
        f"in {first.seconds:.3f} s (allocated {first.allocated_bytes} bytes), second "
        f"{second.seconds:.3f} s, onload {moves[0][1].seconds:.3f} s"
    )
    if floor is not None:
        detail += f"; pinned-copy floor {floor:.3f} s ({first.seconds / floor:.1f}x)"
    del actor, offloader
    return ok, detail


def _pinned_copy_seconds(nbytes: int) -> float | None:
    """One device -> pinned host copy of `nbytes` (CUDA), after a warm-up copy."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start
