"""Model shapes for planning: parameter counts per (TP rank, pipeline stage) from an HF config's
numbers alone, exact for megatron-core's GPTModel with the local / TE layer spec (checked against
real Megatron models at TP1, TP2 and PP2 by tests/parallel/offload_worker.py). Pure arithmetic, no megatron import;
``parallel.memory_terms`` turns these counts into bytes, ``parallel.memory_plan`` into phases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The Megatron linears of a layer that take LoRA adapters (parallel.lora), in layer order.
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """From an HF config.json dict (Qwen2 / Llama)."""
        heads = cfg["num_attention_heads"]
        qkv_bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))
        return cls(
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
        )


def _qwen(h, layers, heads, kv, ffn, vocab, tied) -> ModelShape:
    return ModelShape(h, layers, heads, kv, h // heads, ffn, vocab, tied, True)


# HF config.json shapes of common checkpoints, for planning before the weights are on disk.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen(5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": _qwen(5120, 64, 40, 8, 27648, 152064, False),
    "llama-3-8b": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False, False),
    "meta-llama-3-8b": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False, False),
}


def known_shape(model_path: str) -> ModelShape | None:
    """The shape for a model path's basename (case-insensitive, '-Instruct' ignored)."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    return KNOWN_SHAPES.get(name)


# ---------------------------------------------------------------------------------------------
# Parameters (exact for megatron-core's GPTModel with the local / TE layer spec)


def layer_params(shape: ModelShape, tp: int) -> int:
    """One transformer layer's parameters on one TP rank: two RMSNorms (replicated), fused QKV
    (+ bias for Qwen2), attention output projection, gated fc1 (2 * ffn) and fc2, column / row
    split over TP."""
    qkv_out = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    attn = (qkv_out * shape.hidden + (qkv_out if shape.qkv_bias else 0)) // tp
    attn += shape.hidden * shape.heads * shape.head_dim // tp
    mlp = 3 * shape.ffn * shape.hidden // tp
    return 2 * shape.hidden + attn + mlp


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp  # as parallel.model.padded_vocab_size


def stage_params(shape: ModelShape, *, tp: int, pp: int, pp_rank: int, critic: bool = False) -> int:
    """Parameters held by one (TP rank, pipeline stage), all virtual chunks together."""
    first, last = pp_rank == 0, pp_rank == pp - 1
    count = shape.layers // pp * layer_params(shape, tp)
    embedding = padded_vocab(shape.vocab, tp) // tp * shape.hidden
    if first:
        count += embedding
    if last:
        count += shape.hidden  # final norm
        if critic:
            count += shape.hidden + 1  # value head, replicated
        elif not shape.tied or pp > 1:  # a tied head is a second copy on the last stage
            count += embedding
    return count


def max_stage_params(shape: ModelShape, *, tp: int, pp: int, critic: bool = False) -> int:
    return max(stage_params(shape, tp=tp, pp=pp, pp_rank=r, critic=critic) for r in range(pp))


# ---------------------------------------------------------------------------------------------
# LoRA adapters (exact for parallel.lora; checked against the built adapters by
# tests/parallel/lora_worker.py at TP1, TP2 and PP2)


def lora_target_features(shape: ModelShape, target: str) -> list[tuple[int, int, str]]:
    """(in_features, out_features, "column" | "row") of each HF module a Megatron linear holds:
    linear_qkv is q, k, v; linear_proj o; linear_fc1 gate, up; linear_fc2 down."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {
        "linear_qkv": [(shape.hidden, n, "column") for n in (q, kv, kv)],
        "linear_proj": [(q, shape.hidden, "row")],
        "linear_fc1": [(shape.hidden, shape.ffn, "column")] * 2,
        "linear_fc2": [(shape.ffn, shape.hidden, "row")],
    }[target]


def lora_layer_params(
    shape: ModelShape, *, tp: int, rank: int, target_modules: tuple[str, ...]
) -> int:
    """One layer's adapter parameters on one TP rank: per HF module A [r, in] and B [out, r];
    column-parallel modules split B's rows over TP, row-parallel ones A's columns."""
    count = 0
    for target in target_modules:
        for fan_in, fan_out, parallel in lora_target_features(shape, target):
            if parallel == "column":
                count += rank * fan_in + fan_out // tp * rank
            else:
                count += rank * fan_in // tp + fan_out * rank
    return count


def lora_stage_params(
    shape: ModelShape, *, tp: int, pp: int, rank: int, target_modules: tuple[str, ...]
) -> int:
    """Adapter parameters (all trainable) on one (TP rank, pipeline stage); the same on every
    stage, since layers split evenly. `target_modules`: names from LORA_TARGET_MODULES."""
    unknown = set(target_modules) - set(LORA_TARGET_MODULES)
    if unknown:
        raise ValueError(f"unknown LoRA target modules {sorted(unknown)}: {LORA_TARGET_MODULES}")
    per_layer = lora_layer_params(shape, tp=tp, rank=rank, target_modules=target_modules)
    return shape.layers // pp * per_layer
