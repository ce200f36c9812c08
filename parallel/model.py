"""Build megatron-core GPTModel chunks for HF checkpoints of the families in parallel/convert/.

Public API (stable):

    padded_vocab_size(vocab_size, tp) -> int
    transformer_config_from_hf(hf_config, *, tp, pp, vpp=None, dtype=torch.float32,
                               sequence_parallel=False, transformer_impl="local",
                               recompute=Recompute(), ep=1, etp=None,
                               moe=MoeOptions()) -> TransformerConfig
    build_model(hf_config, mesh, *, dtype=torch.float32, critic=False, head_bias=True,
                options=ModelBuildOptions()) -> list[torch.nn.Module]
    layer_spec(config, backends, vp_stage=None) -> megatron ModuleSpec of this rank's layers
    ValueHead

Layers and core attention (`model.transformer_impl`, `model.attention_backend`) are resolved by
`parallel.model_backends` (TE's layers and attention where TE imports, else megatron's local
layers with `parallel.attention.SDPAttention`); `build_model` raises its ModelConfigError for a
setting this machine cannot build. Fused kernels (gradient-accumulation, RoPE, bias-activation,
masked-softmax fusion) are on exactly when their kernels are installed.

Build options (`parallel.model_options.ModelBuildOptions`): sequence parallelism, backends,
activation recomputation, MoE knobs, packed sequences. MoE models (`parallel.moe`): experts laid
out by the mesh's ep / etp; `options.moe`: training knobs (aux_loss_coef, load_balancing,
token_dispatcher; None: the defaults).

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
    out = chunk(input_ids, position_ids, attention_mask=None, packed_seq_params=params)
        packed sequences (attention "sdpa" or "te"): one row [1, t] of whole sequences end to
        end, position ids restarting per sequence, `params` megatron's PackedSeqParams in THD
        with `cu_seqlens` (`parallel.packing`); the output has the same [1, t, ...] layout.

    Output on the post_process chunk:
        policy: logits [b, s, padded_vocab / tp] (this TP rank's vocab slice, fp32 in fp32 runs;
                with labels=... GPTModel returns the per-token CE loss [b, s] instead)
        critic: values [b, s] (ValueHead; sequence-parallel input is gathered first); a reward
                model is one with `head_bias=False` (`parallel.reward_model`).
    Output of other chunks: hidden states [s, b, h] (sequence-first; [s/tp, b, h] with sequence
    parallelism), which the pipeline schedule sends to the next stage.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig

from parallel.attention import SDPAttention, sdpa_unsupported_options
from parallel.convert.registry import get_family, multimodal_parts
from parallel.cpu_compat import device
from parallel.linear_attention import (
    check_linear_attention,
    hybrid_block_spec,
    linear_attention_fields,
)
from parallel.mesh import Mesh, ParallelLayoutError
from parallel.model_backends import (
    Backends,
    ModelConfigError,
    check_model_settings,
    fused_kernel_options,
)
from parallel.model_options import ModelBuildOptions, MoeOptions, Recompute
from parallel.moe import moe_config_fields, prepare_moe_chunk
from parallel.rope import rope_model_kwargs
from parallel.vision_language import VisionLanguageModel, vision_language_kwargs
from parallel.vocab import padded_vocab_size


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp: int,
    pp: int,
    vpp: int | None = None,
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    transformer_impl: str = "local",
    recompute: Recompute = Recompute(),
    ep: int = 1,
    etp: int | None = None,
    moe: MoeOptions = MoeOptions(),
) -> TransformerConfig:
    """TransformerConfig equal in architecture to an HF config of a supported family (dropout
    off). `transformer_impl` is a resolved one ("transformer_engine" or "local"); it decides
    which fused kernels are switched on. `recompute`: activation recomputation (megatron's
    `recompute_granularity`, `recompute_method`, `recompute_num_layers`). MoE: `ep`, `etp`
    (default tp) lay the experts out, `moe`: the knobs of `parallel.moe.moe_config_fields`
    (ModelConfigError when dense)."""
    family = get_family(hf_config.model_type)
    architecture = family.megatron_options(hf_config)
    experts: dict[str, Any] = {}
    if architecture.get("num_moe_experts") is not None:
        te = transformer_impl == "transformer_engine"
        experts = moe_config_fields(
            hf_config,
            tp=tp,
            ep=ep,
            etp=etp or tp,
            grouped_gemm=te,
            aux_loss_coef=moe.aux_loss_coef,
            load_balancing=moe.load_balancing,
            token_dispatcher=moe.token_dispatcher,
            routing_replay=moe.routing_replay,
        )
    elif ep > 1 or (etp or tp) != tp or moe.any_set:
        raise ModelConfigError(
            f"{hf_config.model_type} has no experts (config.json): parallel.ep, "
            "parallel.expert_tp and model.moe_* are for MoE models; leave them unset"
        )
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
    rope_model_kwargs(hf_config)  # validate RoPE early
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hf_config.hidden_size,
        # a MoE model whose every layer is MoE may have no dense width (Qwen3.5-MoE)
        ffn_hidden_size=getattr(hf_config, "intermediate_size", None)
        or hf_config.moe_intermediate_size,
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
        **architecture,
        **linear_attention_fields(architecture, transformer_impl),
        **experts,
        **recompute.config_fields(),
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


def layer_spec(config: TransformerConfig, backends: Backends, vp_stage: int | None = None):
    """Megatron's layer spec for resolved backends: TE's, or the local one with its core
    attention as chosen (megatron's DotProductAttention, or SDPAttention); for a MoE model, the
    block spec of this rank's layers (MoE and dense layers as `config.moe_layer_freq` says); for
    a hybrid linear-attention model, `parallel.linear_attention.hybrid_block_spec`."""
    te = backends.transformer_impl == "transformer_engine"
    if config.experimental_attention_variant is not None:
        return hybrid_block_spec(config, backends, vp_stage)
    if config.num_moe_experts is not None:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage
        )
        layers = spec.layer_specs
    elif te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(
            normalization=config.normalization, qk_layernorm=config.qk_layernorm
        )
        layers = [spec]
    if backends.attention == "sdpa":
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def compute_logits_batch_first(output_layer: torch.nn.Module) -> None:
    """Make the LM head compute its logits batch-first, in the layout GPTModel returns.

    GPTModel computes logits [s, b, V] and returns ``logits.transpose(0, 1).contiguous()``: a
    copy of the largest activation in the model (and one more of its gradient in backward).
    Transposing the hidden states [s, b, h] into the head instead (h << V) and handing back a
    transposed view of its [b, s, V] result makes that transpose a no-op: one logits-sized
    tensor less at the peak. Hooks keep the module and its state-dict keys megatron's. Not
    while the head runs sequence-parallel (megatron may switch that per call): it then gathers
    its input along the sequence, dim 0.
    """

    def hidden_batch_first(module, args, kwargs):
        if module.sequence_parallel:
            return None
        return (args[0].transpose(0, 1), *args[1:]), kwargs

    def logits_sequence_first(module, args, kwargs, output):
        if module.sequence_parallel:
            return None
        logits, bias = output
        return logits.transpose(0, 1), bias

    output_layer.register_forward_pre_hook(hidden_batch_first, with_kwargs=True)
    output_layer.register_forward_hook(logits_sequence_first, with_kwargs=True)


def build_model(
    hf_config: Any,
    mesh: Mesh,
    *,
    dtype: torch.dtype = torch.float32,
    critic: bool = False,
    head_bias: bool = True,
    options: ModelBuildOptions = ModelBuildOptions(),
) -> list[torch.nn.Module]:
    """GPTModel chunks for this rank (see module docstring); randomly initialised — load weights
    with `parallel.convert.load_hf_weights`. `critic=True` swaps the LM head for a ValueHead,
    with a bias unless `head_bias=False` (a reward model's score head). `options`: the
    layout (``parallel.model_options.ModelBuildOptions``); the experts follow the mesh's ep /
    etp; ``options.pack_sequences`` checks that the model can serve packed micro-batches
    (`parallel.schedule.forward_backward(pack_sequences=True)`). Raises ModelConfigError for a setting this machine cannot build
    (`parallel.model_backends.check_model_settings`)."""
    hf_config, multimodal = multimodal_parts(hf_config)
    if multimodal is not None and (critic or options.sequence_parallel):
        raise ModelConfigError(
            f"{multimodal.model_type}: a vision-language model trains as the policy, without "
            "sequence parallelism, for now (its image features join the embeddings whole)"
        )
    backends = check_model_settings(
        options.transformer_impl,
        options.attention_backend,
        options.sequence_parallel,
        mesh.tp,
        options.pack_sequences,
        hf_config,
    )
    check_linear_attention(hf_config, mesh.tp, options.pack_sequences)
    config = transformer_config_from_hf(
        hf_config,
        tp=mesh.tp,
        pp=mesh.pp,
        vpp=mesh.vpp,
        dtype=dtype,
        sequence_parallel=options.sequence_parallel,
        transformer_impl=backends.transformer_impl,
        recompute=options.recompute,
        ep=mesh.ep,
        etp=mesh.etp,
        moe=options.moe,
    )
    problems = sdpa_unsupported_options(config) if backends.attention == "sdpa" else []
    if problems:
        raise ModelConfigError(
            f"model.attention_backend=sdpa does not implement {'; '.join(problems)}: set "
            "model.attention_backend=local (megatron's unfused attention) or te"
        )
    tie = bool(getattr(hf_config, "tie_word_embeddings", False)) and not critic
    num_chunks = mesh.vpp or 1
    chunks = []
    for vp_stage in range(num_chunks):
        post_process = mesh.is_last_stage and vp_stage == num_chunks - 1
        pre_process = mesh.is_first_stage and vp_stage == 0
        model_class, extra = (CriticGPTModel if critic else GPTModel), {}
        if multimodal is not None:
            model_class = VisionLanguageModel
            extra = vision_language_kwargs(multimodal, pre_process, options.train_vision_tower)
            extra["position_embedding_type"] = "mrope"
        chunk = model_class(
            config=config,
            transformer_layer_spec=layer_spec(config, backends, vp_stage if mesh.vpp else None),
            vocab_size=padded_vocab_size(hf_config.vocab_size, mesh.tp),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie,
            vp_stage=vp_stage if mesh.vpp else None,
            **{**rope_model_kwargs(hf_config), **extra},
        )
        if critic and post_process:
            chunk.output_layer = ValueHead(config, bias=head_bias)
            _same_on_tensor_parallel_ranks(chunk.output_layer)
        elif post_process:
            compute_logits_batch_first(chunk.output_layer)
        if config.num_moe_experts is not None:
            prepare_moe_chunk(chunk)
        chunk.unpadded_vocab_size = hf_config.vocab_size
        chunk.hf_config = hf_config  # lets parallel.convert export without being handed it
        chunk.multimodal_config = multimodal  # what a vision-language checkpoint's export writes
        # Every parameter in the model dtype, as megatron's Float16Module makes it: megatron's
        # local-spec norms are created in fp32 whatever params_dtype says, and a bf16 model
        # with fp32 norms breaks the bf16 optimizers' checkpoints (their sharded state dicts
        # assume one dtype per model).
        chunk.to(device=device(), dtype=dtype)
        chunks.append(chunk)
    return chunks
