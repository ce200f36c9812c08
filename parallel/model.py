"""Build megatron-core GPTModel chunks for HF Qwen2 / Qwen2.5 / Llama checkpoints.

Public API (stable):

    padded_vocab_size(vocab_size, tp) -> int
    transformer_config_from_hf(hf_config, *, tp, pp, vpp=None, dtype=torch.float32,
                               sequence_parallel=False, transformer_impl="local",
                               recompute=None) -> TransformerConfig
    build_model(hf_config, mesh, *, dtype=torch.float32, critic=False, head_bias=True,
                sequence_parallel=False, transformer_impl="auto", recompute=None)
                -> list[torch.nn.Module]
    resolve_transformer_impl(transformer_impl) -> "transformer_engine" | "local"
    check_model_settings(transformer_impl, sequence_parallel, tp) -> resolved transformer_impl
    transformer_engine_status() -> (importable, reason)
    ModelConfigError(ValueError)   (message names the config key to change)
    ValueHead

Transformer implementation (`model.transformer_impl`): "transformer_engine" uses TE's layers
(fused attention, sequence parallelism, fused RoPE); "local" uses megatron's own torch layers,
whose attention materialises the full [b, heads, s, s] score matrix (about 2 GB per layer at 5k
tokens, micro-batch 2). "auto" takes TE when it imports and, on CPU, the local layers; on CUDA
without a working TE it is an error, so a missing or broken TE never silently costs memory.
TE is detected by importing it: a TE whose import fails (ABI mismatch with torch) is reported
at startup with the import error, not deep inside the first forward.
Fused kernels (gradient-accumulation, RoPE, bias-activation, masked-softmax fusion) are on
exactly when their kernels are installed (see `fused_kernel_options`).

Vocab padding rule: the embedding and output layer hold `padded_vocab_size(V, tp)` rows, V
rounded up to a multiple of tp (each TP rank holds an equal slice). Rows >= V are zero on load
and dropped on export. The padded logit columns are meaningless: log-prob code must mask
columns >= `hf_config.vocab_size` (also stored on each chunk as `chunk.unpadded_vocab_size`)
before any softmax. On TP rank r the local logit column j is global token id
`r * padded_vocab_size(V, tp) // tp + j`.

Chunks: `build_model` returns one plain (not DDP-wrapped) GPTModel per virtual pipeline stage
on this rank (a list of one without vpp), in virtual-stage order. The first chunk of pipeline
stage 0 embeds tokens (pre_process); the last chunk of the last stage has the output layer
(post_process). Layer i of the HF model lives on the chunk whose `decoder.layers[k].layer_number
- 1 == i` (megatron's layer offset rule: layers split evenly over pp * vpp virtual stages).

Forward call (megatron-core 0.16 - 0.19):

    out = chunk(input_ids, position_ids, attention_mask=None)
        input_ids, position_ids: [b, s] int64 (position_ids = arange(s) per row); the causal
        mask is built in; pass attention_mask=None. Right padding is fine for causal LMs.
        Non-first pipeline stages take their input through `chunk.set_input_tensor(...)`
        (megatron's pipeline schedule does that); they still receive input_ids/position_ids
        (used for RoPE positions only on the first stage; pass the same tensors everywhere).

    Output on the post_process chunk:
        policy: logits [b, s, padded_vocab / tp] (this TP rank's vocab slice, fp32 in fp32 runs;
                with labels=... GPTModel returns the per-token CE loss [b, s] instead)
        critic: values [b, s] (ValueHead; sequence-parallel input is gathered first); a reward
                model is one with `head_bias=False` (`parallel.reward_model`).
    Output of other chunks: hidden states [s, b, h] (sequence-first; [s/tp, b, h] with sequence
    parallelism), which the pipeline schedule sends to the next stage.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig

from parallel.convert.registry import get_family
from parallel.cpu_compat import device
from parallel.mesh import Mesh, ParallelLayoutError
from parallel.vocab import padded_vocab_size

TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")


class ModelConfigError(ValueError):
    """A model setting this machine cannot run; the message names the config key."""


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


def resolve_transformer_impl(transformer_impl: str = "auto") -> str:
    """The layer implementation to build: "transformer_engine" or "local" (module docstring)."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ModelConfigError(
            f"model.transformer_impl={transformer_impl!r}: choose one of {TRANSFORMER_IMPLS}"
        )
    if transformer_impl == "local":
        return "local"
    available, why = transformer_engine_status()
    if available:
        return "transformer_engine"
    if transformer_impl == "transformer_engine":
        raise ModelConfigError(
            f"model.transformer_impl=transformer_engine but {why}; install the gpu extra "
            "(pip install -e .[gpu]) or set model.transformer_impl=local"
        )
    if torch.cuda.is_available():
        raise ModelConfigError(
            f"{why}. On CUDA rlcli needs it for memory-efficient attention and sequence "
            "parallelism: install the gpu extra (pip install -e .[gpu]), or set "
            "model.transformer_impl=local to use megatron's local layers (attention then "
            "materialises the full score matrix: short sequences only)"
        )
    return "local"


def check_model_settings(transformer_impl: str, sequence_parallel: bool, tp: int) -> str:
    """Startup check of model.transformer_impl and parallel.sequence_parallel (ModelConfigError
    naming the key); returns the resolved transformer_impl. `build_model` calls it too."""
    transformer_impl = resolve_transformer_impl(transformer_impl)
    if sequence_parallel and tp > 1 and transformer_impl != "transformer_engine":
        # megatron's local spec norm (torch RMSNorm) asserts it is not sequence-parallel
        why = transformer_engine_status()[1] or "model.transformer_impl=local"
        raise ModelConfigError(
            f"parallel.sequence_parallel=true needs Transformer Engine ({why}); set "
            "parallel.sequence_parallel=false or install the gpu extra"
        )
    return transformer_impl


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a kernel extension that fails to load is absent
        return False
    return True


def fused_kernel_options(transformer_impl: str) -> dict[str, bool]:
    """Megatron's fusion switches, each on exactly when its kernel is installed (CUDA only).

    gradient_accumulation_fusion: TE's linear layers, or apex's fused_weight_gradient_mlp_cuda
    for the local ones; apply_rope_fusion: TE's fused RoPE; bias_activation_fusion: megatron's
    own fused SwiGLU (torch.jit, any CUDA); masked_softmax_fusion: megatron's / apex's
    scaled_upper_triang_masked_softmax_cuda (TE's attention fuses softmax itself).
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


# Llama 3.1-style RoPE scaling: megatron-core implements only these constants.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings from transformers 5 (`rope_parameters`) or 4 (`rope_theta`, `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _rope_model_kwargs(hf_config: Any) -> dict[str, Any]:
    rope = _rope_parameters(hf_config)
    kwargs = {"position_embedding_type": "rope", "rotary_base": rope["rope_theta"]}
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


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp: int,
    pp: int,
    vpp: int | None = None,
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    transformer_impl: str = "local",
    recompute: dict[str, Any] | None = None,
) -> TransformerConfig:
    """TransformerConfig equal in architecture to an HF Qwen2 / Llama config (dropout off).
    `transformer_impl` is a resolved one ("transformer_engine" or "local"); it decides which
    fused kernels are switched on. `recompute`: megatron's activation-recomputation fields
    (`recompute_granularity`, `recompute_method`, `recompute_num_layers`), see
    `parallel.memory_terms.recompute_options`."""
    family = get_family(hf_config.model_type)
    num_layers = hf_config.num_hidden_layers
    stages = pp * (vpp or 1)
    if num_layers % stages:
        raise ParallelLayoutError(
            f"{num_layers} layers (config.json num_hidden_layers) cannot be split evenly over "
            f"parallel.pp * parallel.vpp = {stages} pipeline stages"
        )
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if num_kv_heads % tp:
        raise ParallelLayoutError(
            f"parallel.tp={tp} must divide the model's {num_kv_heads} key/value heads "
            f"(config.json num_key_value_heads)"
        )
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} unsupported (only 'silu')")
    head_dim = getattr(hf_config, "head_dim", None)
    head_dim = head_dim or hf_config.hidden_size // hf_config.num_attention_heads
    _rope_model_kwargs(hf_config)  # validate RoPE early
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=num_kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        **fused_kernel_options(transformer_impl),
        **family.megatron_options(hf_config),
        **(recompute or {}),
    )


class ValueHead(torch.nn.Module):
    """Scalar head replacing GPTModel.output_layer: hidden [s, b, h] -> values [s, b].

    GPTModel transposes its output layer's result to batch-first, so the chunk returns values
    [b, s]. The head is replicated on every TP rank (its input is TP-replicated after the final
    norm; with sequence parallelism the sequence shards are gathered first). Its weights map to
    HF `score.weight` [1, h] and, with `bias=True`, `score.bias` [1]: a PPO critic's head has a
    bias (as *ForTokenClassification), a reward model's none (as *ForSequenceClassification).
    """

    def __init__(self, config: TransformerConfig, bias: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.value = torch.nn.Linear(config.hidden_size, 1, bias=bias, dtype=config.params_dtype)
        with torch.no_grad():
            config.init_method(self.value.weight)
            if bias:
                self.value.bias.zero_()

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        return self.value(hidden_states).squeeze(-1), None


class CriticGPTModel(GPTModel):
    """A GPTModel whose output layer is a ValueHead (`build_model(critic=True)`): a PPO critic
    or a reward model."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        # megatron's LanguageModule marks the last stage's LM head `output_layer.weight` as
        # vocab-padded; a value head has no such tensor (its `output_layer.value.*` are plain
        # replicated tensors), so the last stage answers as a stage without an LM head.
        post_process, self.post_process = self.post_process, False
        try:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self.post_process = post_process


def _same_on_tensor_parallel_ranks(module: torch.nn.Module) -> None:
    """Every TP rank holds a full copy of the value head and must hold the SAME one: each rank
    computes the values (and the advantages built from them) with its own copy. Its random
    initialisation draws from a generator the ranks may have advanced differently, so the
    copy of TP rank 0 is broadcast."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    source = parallel_state.get_tensor_model_parallel_src_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    for param in module.parameters():
        data = param.data.to(device())
        torch.distributed.broadcast(data, source, group=group)
        param.data.copy_(data)


def layer_spec(config: TransformerConfig, transformer_impl: str):
    """Megatron's layer spec for a resolved `transformer_impl`."""
    if transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=config.normalization)


def build_model(
    hf_config: Any,
    mesh: Mesh,
    *,
    dtype: torch.dtype = torch.float32,
    critic: bool = False,
    head_bias: bool = True,
    sequence_parallel: bool = False,
    transformer_impl: str = "auto",
    recompute: dict[str, Any] | None = None,
) -> list[torch.nn.Module]:
    """GPTModel chunks for this rank (see module docstring); randomly initialised — load weights
    with `parallel.convert.load_hf_weights`. `critic=True` swaps the LM head for a ValueHead,
    with a bias unless `head_bias=False` (a reward model's score head).
    `sequence_parallel=True` (TP > 1) needs Transformer Engine. `recompute`: activation
    recomputation fields for TransformerConfig. Raises ModelConfigError for a setting this
    machine cannot build (see `resolve_transformer_impl`)."""
    transformer_impl = check_model_settings(transformer_impl, sequence_parallel, mesh.tp)
    config = transformer_config_from_hf(
        hf_config,
        tp=mesh.tp,
        pp=mesh.pp,
        vpp=mesh.vpp,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        transformer_impl=transformer_impl,
        recompute=recompute,
    )
    tie = bool(getattr(hf_config, "tie_word_embeddings", False)) and not critic
    num_chunks = mesh.vpp or 1
    chunks = []
    for vp_stage in range(num_chunks):
        post_process = mesh.is_last_stage and vp_stage == num_chunks - 1
        chunk = (CriticGPTModel if critic else GPTModel)(
            config=config,
            transformer_layer_spec=layer_spec(config, transformer_impl),
            vocab_size=padded_vocab_size(hf_config.vocab_size, mesh.tp),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=mesh.is_first_stage and vp_stage == 0,
            post_process=post_process,
            share_embeddings_and_output_weights=tie,
            vp_stage=vp_stage if mesh.vpp else None,
            **_rope_model_kwargs(hf_config),
        )
        if critic and post_process:
            chunk.output_layer = ValueHead(config, bias=head_bias)
            _same_on_tensor_parallel_ranks(chunk.output_layer)
        chunk.unpadded_vocab_size = hf_config.vocab_size
        chunk.hf_config = hf_config  # lets parallel.convert export without being handed it
        # Every parameter in the model dtype, as megatron's Float16Module makes it: megatron's
        # local-spec norms are created in fp32 whatever params_dtype says, and a bf16 model
        # with fp32 norms breaks the bf16 optimizers' checkpoints (their sharded state dicts
        # assume one dtype per model).
        chunk.to(device=device(), dtype=dtype)
        chunks.append(chunk)
    return chunks
