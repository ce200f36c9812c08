"""Model shapes for planning: parameter counts per (TP rank, pipeline stage, EP rank) from an HF
config's numbers alone, exact for megatron-core's GPTModel with the local / TE layer spec
(checked against real Megatron models at TP1, TP2 and PP2 by tests/parallel/offload_worker.py,
and for MoE models at TP2, PP2, EP2 and TP2 x EP2 by tests/parallel/parity_worker.py). Pure
arithmetic, no megatron import; ``parallel.memory_terms`` turns these counts into bytes,
``parallel.memory_plan`` into phases.

Mixture-of-experts layers replace the MLP by a router (E x h, replicated), E routed experts of
3 * moe_ffn * h each (E/ep per expert-parallel rank, split over the expert-TP group) and, for
Qwen2-MoE, a shared expert (split over TP) with its sigmoid gate (1 x h, replicated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from parallel.vision_shape import VisionShape

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "qwen3_next")
# Qwen3.5 and Qwen3-Next: Qwen3's QK-norm, a gate per query head, Gated DeltaNet layers
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")

# The Megatron linears of a layer that take LoRA adapters (parallel.lora), in layer order.
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def num_experts_of(cfg: dict[str, Any]) -> int:
    """Routed experts per MoE layer in a config.json dict (0: dense). Checkpoints spell it
    `num_experts`; transformers 5 writes `num_local_experts` (its alias) when it saves one."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


@dataclass(frozen=True)
class LinearAttentionShape:
    """The Gated DeltaNet layers of a hybrid model (config.json's linear_* keys)."""

    layers: tuple[int, ...]  # 1 = Gated DeltaNet, 0 = full attention
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LinearAttentionShape | None:
        layer_types = cfg.get("layer_types") or []
        if "linear_attention" not in layer_types:
            return None
        return cls(
            layers=tuple(int(kind == "linear_attention") for kind in layer_types),
            key_heads=cfg["linear_num_key_heads"],
            value_heads=cfg["linear_num_value_heads"],
            key_dim=cfg["linear_key_head_dim"],
            value_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"],
        )

    def params(self, hidden: int, tp: int) -> int:
        """One Gated DeltaNet on one TP rank: in_proj (q, k, v, output gate z, beta, alpha),
        the depthwise conv over q, k, v, A_log and dt_bias per value head (all split over TP),
        the gated output norm (head_dim, replicated) and out_proj."""
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        in_proj = hidden * (2 * keys + 2 * values + 2 * self.value_heads) // tp
        conv = (2 * keys + values) * self.conv_kernel // tp
        per_head = 2 * self.value_heads // tp
        return in_proj + conv + per_head + self.value_dim + values * hidden // tp


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
    qk_norm: bool = False  # Qwen3: RMSNorm (head_dim) on queries and keys
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    topk: int = 0  # experts per token
    moe_ffn: int = 0  # one routed expert's width
    shared_ffn: int = 0  # the shared expert's width (0: none)
    moe_layers: tuple[int, ...] | None = None  # 1 = MoE layer, 0 = dense MLP; None: all MoE
    attention_gate: bool = False  # Qwen3.5: a sigmoid output gate per query head
    linear: LinearAttentionShape | None = None  # Qwen3.5's Gated DeltaNet layers, if any
    vision: VisionShape | None = None  # a vision-language model's tower (on the first stage)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_linear_layer(self, layer: int) -> bool:
        return self.linear is not None and bool(self.linear.layers[layer])

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (self.moe_layers is None or bool(self.moe_layers[layer]))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """From an HF config.json dict (Qwen2 / Llama / Qwen3 / Qwen2-MoE / Qwen3-MoE /
        Qwen3.5 text / Qwen3.5-MoE text / Qwen3-Next)."""
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type")
        qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
        if model_type == "qwen2_moe":
            qkv_bias = bool(cfg.get("qkv_bias", True))
        moe = {}
        if model_type in MOE_MODEL_TYPES and num_experts_of(cfg):
            dense = set(cfg.get("mlp_only_layers") or [])
            step = cfg.get("decoder_sparse_step") or 1
            pattern = tuple(
                int(i not in dense and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"])
            )
            moe = dict(
                experts=num_experts_of(cfg),
                topk=cfg["num_experts_per_tok"],
                moe_ffn=cfg["moe_intermediate_size"],
                shared_ffn=cfg.get("shared_expert_intermediate_size") or 0,
                moe_layers=None if all(pattern) else pattern,
            )
        return cls(
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size", 0),
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", *HYBRID_MODEL_TYPES),
            attention_gate=model_type in HYBRID_MODEL_TYPES,
            linear=LinearAttentionShape.from_hf_config(cfg),
            **moe,
        )


def _qwen(h, layers, heads, kv, ffn, vocab, tied) -> ModelShape:
    return ModelShape(h, layers, heads, kv, h // heads, ffn, vocab, tied, True)


def _qwen3(h, layers, heads, kv, ffn, tied, **moe) -> ModelShape:
    return ModelShape(h, layers, heads, kv, 128, ffn, 151936, tied, False, True, **moe)


def _hybrid_moe(layers: int, ffn: int, vocab: int, experts: int, topk: int) -> ModelShape:
    """Qwen3-Next / Qwen3.5-MoE: hidden 2048, 16 query / 2 KV heads of 256, three Gated DeltaNet
    layers (16 key / 32 value heads of 128, conv 4) to each gated attention layer, routed
    experts of 512 and a shared expert of 512 in every layer (`ffn`: the dense MLP's width that
    config.json states, used by no layer of these two)."""
    linear = LinearAttentionShape(
        layers=tuple(int((i + 1) % 4 != 0) for i in range(layers)),
        key_heads=16,
        value_heads=32,
        key_dim=128,
        value_dim=128,
        conv_kernel=4,
    )
    return ModelShape(
        2048, layers, 16, 2, 256, ffn, vocab, False, False, True,
        experts=experts, topk=topk, moe_ffn=512, shared_ffn=512, attention_gate=True,
        linear=linear,
    )  # fmt: skip


# HF config.json shapes of common checkpoints, for planning before the weights are on disk.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen(5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": _qwen(5120, 64, 40, 8, 27648, 152064, False),
    "qwen2.5-vl-7b": dataclasses.replace(
        _qwen(3584, 28, 28, 4, 18944, 152064, False),
        vision=VisionShape(
            depth=32, hidden=1280, ffn=3420, out_hidden=3584, patch_dim=1176, merge=2
        ),
    ),
    "llama-3-8b": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False, False),
    "meta-llama-3-8b": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False, False),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 8, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 8, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288, False),
    "qwen3-14b": _qwen3(5120, 40, 40, 8, 17408, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 8, 25600, False),
    "qwen3-30b-a3b": _qwen3(2048, 48, 32, 4, 6144, False, experts=128, topk=8, moe_ffn=768),
    "qwen3-235b-a22b": _qwen3(4096, 94, 64, 4, 12288, False, experts=128, topk=8, moe_ffn=1536),
    "qwen3-next-80b-a3b": _hybrid_moe(48, 5632, 151936, experts=512, topk=10),
    "qwen3.5-35b-a3b": _hybrid_moe(40, 512, 248320, experts=256, topk=8),
}


def known_shape(model_path: str) -> ModelShape | None:
    """The shape for a model path's basename (case-insensitive; '-text', what `rlcli convert
    language-model` suggests for a multimodal checkpoint's language model, then '-Instruct' /
    '-Base' ignored)."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-text")
    name = name.removesuffix("-instruct").removesuffix("-base")
    return KNOWN_SHAPES.get(name)


# ---------------------------------------------------------------------------------------------
# Parameters (exact for megatron-core's GPTModel with the local / TE layer spec)


def attention_params(shape: ModelShape, tp: int, layer: int = 0) -> int:
    """One layer's attention and its two RMSNorms on one TP rank: fused QKV (+ bias for Qwen2;
    + the query heads' output gates for Qwen3.5), output projection, column / row split over
    TP; Qwen3's QK-norms (replicated). A Gated DeltaNet layer: `LinearAttentionShape.params`."""
    if shape.is_linear_layer(layer):
        return 2 * shape.hidden + shape.linear.params(shape.hidden, tp)
    gates = shape.heads if shape.attention_gate else 0
    qkv_out = (shape.heads + gates + 2 * shape.kv_heads) * shape.head_dim
    attn = (qkv_out * shape.hidden + (qkv_out if shape.qkv_bias else 0)) // tp
    attn += shape.hidden * shape.heads * shape.head_dim // tp
    return 2 * shape.hidden + attn + (2 * shape.head_dim if shape.qk_norm else 0)


def layer_params(shape: ModelShape, tp: int, layer: int = 0) -> int:
    """One transformer layer's parameters on one TP rank, routed experts excluded (see
    `expert_layer_params`): attention, and the gated dense MLP (fc1 2 * ffn, fc2) or the MoE
    layer's replicated router and its shared expert."""
    params = attention_params(shape, tp, layer)
    if not shape.is_moe_layer(layer):
        return params + 3 * shape.ffn * shape.hidden // tp
    params += shape.experts * shape.hidden  # router
    if shape.shared_ffn:
        params += 3 * shape.shared_ffn * shape.hidden // tp + shape.hidden  # + its gate
    return params


def expert_layer_params(shape: ModelShape, layer: int, *, ep: int = 1, etp: int = 1) -> int:
    """A layer's routed-expert parameters on one (EP, expert-TP) rank."""
    if not shape.is_moe_layer(layer):
        return 0
    return shape.experts // ep * 3 * shape.moe_ffn * shape.hidden // etp


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp  # as parallel.model.padded_vocab_size


def _stage_layers(shape: ModelShape, pp: int, pp_rank: int) -> range:
    per_stage = shape.layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def stage_expert_params(
    shape: ModelShape, *, pp: int, pp_rank: int, ep: int = 1, etp: int = 1
) -> int:
    """Routed-expert parameters held by one (EP, expert-TP) rank of a pipeline stage (megatron's
    expert parameters: reduced over the expert-data-parallel group, not DP)."""
    layers = _stage_layers(shape, pp, pp_rank)
    return sum(expert_layer_params(shape, i, ep=ep, etp=etp) for i in layers)


def stage_params(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    pp_rank: int,
    critic: bool = False,
    head_bias: bool = True,
    ep: int = 1,
    etp: int | None = None,
) -> int:
    """Parameters held by one (TP rank, pipeline stage, EP rank), all virtual chunks together;
    `etp` (expert TP) defaults to tp. ``critic``: a one-output head instead of the LM head,
    as ``parallel.model.build_model`` builds it: with a bias (PPO's value head) or,
    ``head_bias=False``, without (a reward model's score head)."""
    first, last = pp_rank == 0, pp_rank == pp - 1
    count = sum(layer_params(shape, tp, i) for i in _stage_layers(shape, pp, pp_rank))
    count += stage_expert_params(shape, pp=pp, pp_rank=pp_rank, ep=ep, etp=etp or tp)
    embedding = padded_vocab(shape.vocab, tp) // tp * shape.hidden
    if first:
        count += embedding
        if shape.vision is not None:  # whole on every TP rank
            count += shape.vision.params
    if last:
        count += shape.hidden  # final norm
        if critic:
            count += shape.hidden + (1 if head_bias else 0)  # value / score head, replicated
        elif not shape.tied or pp > 1:  # a tied head is a second copy on the last stage
            count += embedding
    return count


def max_stage_params(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    critic: bool = False,
    head_bias: bool = True,
    ep: int = 1,
    etp: int | None = None,
) -> int:
    return max(
        stage_params(
            shape, tp=tp, pp=pp, pp_rank=r, critic=critic, head_bias=head_bias, ep=ep, etp=etp
        )
        for r in range(pp)
    )


# ---------------------------------------------------------------------------------------------
# LoRA adapters (exact for parallel.lora; checked against the built adapters by
# tests/parallel/lora_worker.py at TP1, TP2 and PP2)


ATTENTION_TARGETS = ("linear_qkv", "linear_proj")  # a Gated DeltaNet layer has neither


def lora_target_features(shape: ModelShape, target: str) -> list[tuple[int, int, str]]:
    """(in_features, out_features, "column" | "row") of each HF module a Megatron linear holds:
    linear_qkv is q, k, v (Qwen3.5's q_proj also makes each head's output gate: twice the
    rows); linear_proj o; linear_fc1 gate, up; linear_fc2 down."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q_rows = 2 * q if shape.attention_gate else q
    return {
        "linear_qkv": [(shape.hidden, n, "column") for n in (q_rows, kv, kv)],
        "linear_proj": [(q, shape.hidden, "row")],
        "linear_fc1": [(shape.hidden, shape.ffn, "column")] * 2,
        "linear_fc2": [(shape.ffn, shape.hidden, "row")],
    }[target]


def layer_lora_targets(shape: ModelShape, layer: int, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets layer `layer` has: all of them, but a Gated DeltaNet layer's attention ones
    (its in_proj / out_proj take no adapters)."""
    if shape.is_linear_layer(layer):
        return tuple(t for t in targets if t not in ATTENTION_TARGETS)
    return targets


def lora_layer_params(
    shape: ModelShape, *, tp: int, rank: int, target_modules: tuple[str, ...], layer: int = 0
) -> int:
    """One layer's adapter parameters on one TP rank: per HF module A [r, in] and B [out, r];
    column-parallel modules split B's rows over TP, row-parallel ones A's columns."""
    count = 0
    for target in layer_lora_targets(shape, layer, target_modules):
        for fan_in, fan_out, parallel in lora_target_features(shape, target):
            if parallel == "column":
                count += rank * fan_in + fan_out // tp * rank
            else:
                count += rank * fan_in // tp + fan_out * rank
    return count


def lora_stage_params(
    shape: ModelShape, *, tp: int, pp: int, rank: int, target_modules: tuple[str, ...]
) -> int:
    """Adapter parameters (all trainable) on one TP rank of the pipeline stage holding the most
    (every stage alike but in a hybrid model). `target_modules`: names from
    LORA_TARGET_MODULES."""
    unknown = set(target_modules) - set(LORA_TARGET_MODULES)
    if unknown:
        raise ValueError(f"unknown LoRA target modules {sorted(unknown)}: {LORA_TARGET_MODULES}")
    return max(
        sum(
            lora_layer_params(shape, tp=tp, rank=rank, target_modules=target_modules, layer=i)
            for i in _stage_layers(shape, pp, pp_rank)
        )
        for pp_rank in range(pp)
    )
