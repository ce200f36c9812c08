"""RoPE settings of megatron-core's GPTModel from an HF config (transformers 4 and 5 spellings).

rope_parameters(hf_config) -> dict    (rope_type, rope_theta, scaling fields)
rope_model_kwargs(hf_config) -> dict  (GPTModel's position_embedding_type, rotary_base,
                                       rotary_percent, rope_scaling, rope_scaling_factor);
                                       ValueError for a scaling megatron-core does not
                                       implement
"""

from __future__ import annotations

from typing import Any

# Llama 3.1-style RoPE scaling: megatron-core implements only these constants.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings from transformers 5 (`rope_parameters`) or 4 (`rope_theta`, `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rope_model_kwargs(hf_config: Any) -> dict[str, Any]:
    rope = rope_parameters(hf_config)
    kwargs = {"position_embedding_type": "rope", "rotary_base": rope["rope_theta"]}
    partial = float(rope.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # Qwen3.5: RoPE on the first quarter of each head's dimensions
        kwargs["rotary_percent"] = partial
    if rope["rope_type"] == "default":
        return kwargs
    if rope["rope_type"] == "llama3" and all(
        float(rope.get(key, -1)) == value for key, value in _MEGATRON_LLAMA3_ROPE.items()
    ):
        return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    raise ValueError(
        f"unsupported RoPE scaling {rope} in config.json: supported are rope_type 'default' and "
        f"'llama3' with {_MEGATRON_LLAMA3_ROPE}"
    )
