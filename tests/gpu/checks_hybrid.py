"""Check 10 of the GPU check: Qwen3.5's hybrid layers (Gated DeltaNet + gated attention) on the GPU.

A small random Qwen3.5 text model (three DeltaNet layers, then gated attention): Megatron's
logits against transformers' in fp32 (both on the GPU; the DeltaNet runs flash-linear-attention's
kernels where installed, else megatron-core's torch delta rule, as the line says), Megatron bf16
against HF fp32 judged by HF's own bf16 error, and one backward in bf16 whose gradients reach
every DeltaNet parameter, finite. Seconds per forward + backward are printed for the record.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tests.gpu.common import BF16, Context

HYBRID_GPU = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, intermediate_size=1024, vocab_size=4099, max_position_embeddings=1024,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64,
)  # fmt: skip
HYBRID_CPU = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
    head_dim=64, intermediate_size=128, vocab_size=251, max_position_embeddings=256,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
    linear_value_head_dim=64,
)  # fmt: skip


def make_hybrid_model(out_dir: Path, shape: dict, seed: int) -> Path:
    """A random fp32 Qwen3.5 text model, norms and dt_bias randomised (a mapping error shows)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if (out_dir / "config.json").exists():
        return out_dir
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    config = Qwen3_5TextConfig(**shape, layer_types=layer_types, rope_parameters=rope)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.normal_(mean=1.0 if "linear_attn.norm" in name else 0.0, std=0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def check_hybrid_layers(ctx: Context) -> tuple[bool, str]:
    from transformers import AutoModelForCausalLM

    from parallel.hf_model import load_hf_model
    from parallel.linear_attention import fla_importable

    model_dir = make_hybrid_model(ctx.work / "hybrid", HYBRID_CPU if ctx.cpu else HYBRID_GPU, 0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(ctx.device)
    vocab = hf.config.vocab_size
    ids = torch.randint(1, vocab, (2, 48 if ctx.cpu else 512), generator=torch.Generator())
    ids = ids.to(ctx.device)
    positions = torch.arange(ids.shape[1], device=ctx.device).expand_as(ids)
    with torch.no_grad():
        reference = hf(ids).logits.float()
        hf_err = float((hf.to(BF16)(ids).logits.float() - reference).abs().mean())
    del hf
    parts, ok = [f"delta rule: {'fla kernels' if fla_importable() else 'torch (no fla)'}"], True
    for dtype in (torch.float32, BF16):
        models = load_hf_model(model_dir, ctx.mesh, dtype=dtype)
        start = time.perf_counter()
        logits = models[0](ids, positions, attention_mask=None)[..., :vocab].float()
        diff = (logits.detach() - reference).abs()
        err, worst = float(diff.mean()), float(diff.max())
        if dtype == torch.float32:
            good = worst < 1e-3
            parts.append(f"fp32 max|dlogit| {worst:.2e} {'ok' if good else 'TOO FAR'}")
        else:
            good = err <= 2 * hf_err + 1e-3
            logits.log_softmax(-1).mean().backward()
            delta_net = [
                (n, p) for n, p in models[0].named_parameters() if "self_attention.in_proj" in n
                or "conv1d" in n or "A_log" in n or "dt_bias" in n or "out_norm" in n
            ]  # fmt: skip
            grads = all(p.grad is not None and bool(p.grad.isfinite().all()) for _, p in delta_net)
            seconds = time.perf_counter() - start
            good = good and grads and len(delta_net) == 3 * 5
            parts.append(
                f"bf16 mean|dlogit| {err:.2e} (HF bf16 {hf_err:.2e}, limit 2x + 1e-3), "
                f"DeltaNet grads {'finite' if grads else 'MISSING'} on {len(delta_net)} tensors, "
                f"forward + backward {seconds:.2f} s ({ids.numel()} tokens)"
            )
        ok = ok and good
        del models
    return ok, "; ".join(parts)
