"""Which layers, core attention and fused kernels a model is built with on this machine.

    transformer_engine_status() -> (importable, reason)
    resolve_backends(transformer_impl="auto", attention_backend="auto") -> Backends
    check_model_settings(transformer_impl, attention_backend, sequence_parallel, tp,
                         pack_sequences=False, hf_config=None) -> Backends
    fused_kernel_options(transformer_impl) -> {TransformerConfig fusion switch: bool}
    ModelConfigError(ValueError)   (message names the config key to change)

Two keys, one decision each, never contradicting:

* ``model.transformer_impl`` picks the LAYERS: "transformer_engine" (TE's fused norm + linear
  layers, sequence parallelism, fused RoPE) or "local" (megatron-core's own torch layers).
* ``model.attention_backend`` picks the CORE ATTENTION inside them: "te" (TE's fused attention,
  TE layers only), "sdpa" (``parallel.attention.SDPAttention`` over torch's
  scaled_dot_product_attention: flash / memory-efficient kernels on GPUs, exact math on CPU;
  local layers only) or "local" (megatron-core's unfused DotProductAttention, which materialises
  the [b, heads, s, s] score matrix in fp32; kept for comparison).

"auto" resolves the two together: TE layers with TE attention where TE imports, else the local
layers with sdpa; an explicit sdpa / local attention makes an auto transformer_impl local, an
explicit te attention needs TE. TE is detected by importing it: a TE whose import fails (ABI
mismatch with torch) is reported at startup with the import error, not deep inside the first
forward. Fused kernels are on exactly when their kernels are installed (``fused_kernel_options``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")
_GPU_EXTRA = "install the gpu extra (pip install -e .[gpu])"


class ModelConfigError(ValueError):
    """A model setting this machine cannot run; the message names the config key."""


@dataclass(frozen=True)
class Backends:
    """The resolved choice: ``transformer_impl`` "transformer_engine" | "local", ``attention``
    "te" | "sdpa" | "local" ("te" exactly with TE layers)."""

    transformer_impl: str
    attention: str


@functools.cache
def transformer_engine_status() -> tuple[bool, str]:
    """(True, "") when `transformer_engine.pytorch` imports; else (False, why)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except ModuleNotFoundError as error:
        if (error.name or "").startswith("transformer_engine"):
            return False, "Transformer Engine is not installed"
        return False, f"Transformer Engine is installed but fails to import: {error}"
    except Exception as error:  # noqa: BLE001 - a broken TE raises anything (OSError, ImportError)
        return False, f"Transformer Engine is installed but fails to import: {error}"
    return True, ""


def resolve_backends(transformer_impl: str = "auto", attention_backend: str = "auto") -> Backends:
    """The layers and core attention to build (module docstring); ModelConfigError names the
    key when a choice is unknown, needs a missing TE, or contradicts the other key."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ModelConfigError(
            f"model.transformer_impl={transformer_impl!r}: choose one of {TRANSFORMER_IMPLS}"
        )
    if attention_backend not in ATTENTION_BACKENDS:
        raise ModelConfigError(
            f"model.attention_backend={attention_backend!r}: choose one of {ATTENTION_BACKENDS}"
        )
    te_ok, why = transformer_engine_status()
    if attention_backend == "te":
        if not te_ok:
            raise ModelConfigError(
                f"model.attention_backend=te but {why}; {_GPU_EXTRA} or set "
                "model.attention_backend=sdpa"
            )
        if transformer_impl == "local":
            raise ModelConfigError(
                "model.attention_backend=te is Transformer Engine's attention, which runs in TE's "
                "layers, but model.transformer_impl=local: set model.transformer_impl=auto (or "
                "transformer_engine), or model.attention_backend=sdpa"
            )
    if transformer_impl == "transformer_engine":
        if not te_ok:
            raise ModelConfigError(
                f"model.transformer_impl=transformer_engine but {why}; {_GPU_EXTRA} or set "
                "model.transformer_impl=local"
            )
        if attention_backend in ("sdpa", "local"):
            raise ModelConfigError(
                f"model.attention_backend={attention_backend} is a core attention of megatron's "
                "local layers, but model.transformer_impl=transformer_engine builds TE's layers "
                "with TE's attention: set model.attention_backend=auto (or te), or "
                "model.transformer_impl=local"
            )
    use_te = te_ok and transformer_impl != "local" and attention_backend in ("auto", "te")
    if use_te:
        return Backends("transformer_engine", "te")
    return Backends("local", "sdpa" if attention_backend == "auto" else attention_backend)


def hf_sliding_window(hf_config: Any) -> int | None:
    """The sliding-window size config.json asks for, or None: full causal attention in every
    layer. transformers 5 lists each layer's kind in `layer_types` (Qwen2 with
    `use_sliding_window` slides only from `max_window_layers` on); older configs say it with
    `sliding_window` (and Qwen2's `use_sliding_window`)."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if window and "sliding_attention" in layer_types else None
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    return int(window)


def check_model_settings(
    transformer_impl: str,
    attention_backend: str,
    sequence_parallel: bool,
    tp: int,
    pack_sequences: bool = False,
    hf_config: Any = None,
) -> Backends:
    """Startup check of the model keys (ModelConfigError naming the key); returns the resolved
    backends. ``pack_sequences``: the micro-batches will run packed (THD), which needs an
    attention with a packed path (sdpa or te) and full causal attention. `build_model` calls it.
    """
    backends = resolve_backends(transformer_impl, attention_backend)
    if sequence_parallel and tp > 1 and backends.transformer_impl != "transformer_engine":
        # megatron's local spec norm (torch RMSNorm) asserts it is not sequence-parallel
        why = transformer_engine_status()[1] or "model.transformer_impl=local"
        raise ModelConfigError(
            f"parallel.sequence_parallel=true needs Transformer Engine ({why}); set "
            "parallel.sequence_parallel=false or install the gpu extra"
        )
    if pack_sequences:
        if backends.attention == "local":
            raise ModelConfigError(
                "pack_sequences=true (actor.* / critic.*) needs model.attention_backend=sdpa (or "
                "te): megatron's local attention (model.attention_backend=local) has no "
                "packed-sequence path"
            )
        window = hf_sliding_window(hf_config) if hf_config is not None else None
        if window is not None:
            raise ModelConfigError(
                f"pack_sequences=true (actor.* / critic.*) cannot serve the sliding-window "
                f"attention of config.json (sliding_window={window}): packed sequences are "
                "attended with full causal attention per sequence; set pack_sequences=false"
            )
    return backends


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a kernel extension that fails to load is absent
        return False
    return True


def fused_kernel_options(transformer_impl: str) -> dict[str, bool]:
    """Megatron's fusion switches, each on exactly when its kernel is installed (CUDA only).

    gradient_accumulation_fusion: TE's linear layers, or apex's fused_weight_gradient_mlp_cuda
    for the local ones; apply_rope_fusion: TE's fused RoPE (off in the local layers, which is
    also what sends packed sequences through megatron's pure-PyTorch THD RoPE);
    bias_activation_fusion: megatron's own fused SwiGLU (torch.jit, any CUDA);
    masked_softmax_fusion: megatron's / apex's scaled_upper_triang_masked_softmax_cuda (only
    the local attention uses it; TE's and sdpa fuse the softmax themselves).
    """
    if not torch.cuda.is_available():
        return dict.fromkeys(
            (
                "gradient_accumulation_fusion",
                "apply_rope_fusion",
                "bias_activation_fusion",
                "masked_softmax_fusion",
            ),
            False,
        )
    te = transformer_impl == "transformer_engine"
    return {
        "gradient_accumulation_fusion": te or _importable("fused_weight_gradient_mlp_cuda"),
        "apply_rope_fusion": te,
        "bias_activation_fusion": True,
        "masked_softmax_fusion": _importable("scaled_upper_triang_masked_softmax_cuda"),
    }
