"""An SDPA core attention for megatron-core's local layers (``model.attention_backend=sdpa``).

    SDPAttention(config, layer_number, attn_mask_type, attention_type, ...)   (a MegatronModule)
    padded_attention(query, key, value, attention_mask, causal, scale) -> context
    packed_attention(query, key, value, packed_seq_params, scale) -> context
    packed_attention_kernel(query) -> "varlen" | "per_sequence"
    sdpa_unsupported_options(config) -> list of "what (which key)" SDPAttention does not implement

It takes the place of megatron-core's ``DotProductAttention`` as the ``core_attention``
submodule of ``get_gpt_layer_local_spec`` (``parallel.model.layer_spec``) with the same
contract: the constructor arguments megatron's ``SelfAttention`` passes, and

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
            packed_seq_params=None) -> context
        padded rows:  query [sq, b, heads/tp, d], key / value [sk, b, groups/tp, d]
                      -> context [sq, b, heads/tp * d]
        packed (THD): query [t, heads/tp, d], key / value [t, groups/tp, d] (megatron squeezes
                      the batch dimension of one packed row) -> context [t, heads/tp * d]

Like the local module it is free of TP and CP communication (heads are already split over the
TP ranks; context parallelism is TE's only) and applies no dropout (RL forwards must be
deterministic: the rollout engine has none). Where megatron's local module materialises the
[b, heads, sq, sk] fp32 score matrix (baddbmm + softmax + bmm), torch's
scaled_dot_product_attention picks a flash / memory-efficient kernel on GPUs and its fused CPU
kernel on CPU; GQA runs without expanding K/V (``enable_gqa``) wherever the chosen kernel
takes it: always on CPU, and on CUDA when the flash kernel can run these inputs (torch's other
CUDA kernels would fall back to the unfused math kernel with ``enable_gqa``, so K/V are
expanded for them instead).

Masks: right-padded rows need no mask (causal attention never looks at later positions, so
real tokens never see the padding); a given ``attention_mask`` follows megatron's convention
(True = masked out). Packed rows (``PackedSeqParams`` in THD with ``cu_seqlens``) are attended
block-diagonally: each sequence causally, never across sequences. On CUDA in bf16 / fp16 that
is torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``), which
never computes a masked block; elsewhere (CPU, fp32) one causal SDPA call per sequence, which
computes exactly the unmasked blocks too (one masked SDPA over the whole packed row computed
all t^2 scores, and measured 3.9x slower than the per-sequence calls on CPU for 7 sequences of
30-128 tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import functional as F

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
# Flash attention (varlen) runs in 16-bit only; fp32 takes the per-sequence path.
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def sdpa_unsupported_options(config: TransformerConfig) -> list[str]:
    """The attention options of ``config`` SDPAttention does not implement, each as "what
    (where it is set)"; empty when it can run the model."""
    problems = []
    if config.window_size is not None:
        problems.append(f"sliding-window attention window_size={config.window_size} (config.json)")
    if config.softmax_type != "vanilla":
        problems.append(f"softmax_type={config.softmax_type!r}")
    if config.apply_query_key_layer_scaling:
        problems.append("apply_query_key_layer_scaling")
    if config.attention_dropout > 0:
        problems.append(
            f"attention dropout {config.attention_dropout} (config.json attention_dropout)"
        )
    if config.context_parallel_size > 1:
        problems.append(
            f"context parallelism (context_parallel_size={config.context_parallel_size})"
        )
    if config.multi_latent_attention:
        problems.append("multi-latent attention")
    return problems


def packed_attention_kernel(query: torch.Tensor) -> str:
    """Which kernel attends a packed row: "varlen" (torch's variable-length flash attention:
    CUDA, 16-bit, head_dim a multiple of 8 up to 256) or "per_sequence" (one causal SDPA per
    sequence). Meta tensors take the CUDA choice: the CPU dry run of the GPU check runs the
    varlen call on them (shapes and autograd, no numbers)."""
    head_dim = query.shape[-1]
    flash_shape = head_dim % 8 == 0 and head_dim <= 256
    on_gpu = query.device.type in ("cuda", "meta")
    return "varlen" if on_gpu and query.dtype in _VARLEN_DTYPES and flash_shape else "per_sequence"


class SDPAttention(MegatronModule):
    """Core attention over ``torch.nn.functional.scaled_dot_product_attention`` (module doc).
    Heads and groups per TP rank are read off the inputs, so it needs no process group."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        problems = sdpa_unsupported_options(config)
        if attention_dropout:
            problems.append(f"attention dropout {attention_dropout}")
        if problems:
            # parallel.model checks the config before building; this guards direct spec users.
            raise ValueError(f"SDPAttention does not implement: {'; '.join(problems)}")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention_bias (megatron's local one neither)")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"qkv_format {packed_seq_params.qkv_format!r}: only 'thd' packs")
            if attention_mask is not None:
                raise ValueError("packed (THD) attention is masked by cu_seqlens, not a mask")
            context = packed_attention(query, key, value, packed_seq_params, self.softmax_scale)
            return context.reshape(context.shape[0], -1)
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) in _CAUSAL_TYPES
        return padded_attention(query, key, value, attention_mask, causal, self.softmax_scale)


def padded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """query [sq, b, heads, d], key / value [sk, b, groups, d] -> context [sq, b, heads * d];
    ``attention_mask`` (True = masked out, megatron's convention) or ``causal``."""
    sq, batch, heads, head_dim = query.shape
    # [s, b, h, d] -> [b, h, s, d], SDPA's layout (a view; the kernels take strides)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    mask = None if attention_mask is None else ~attention_mask
    context = _sdpa(q, k, v, mask, causal, scale)
    return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * head_dim)


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    params: PackedSeqParams,
    scale: float,
) -> torch.Tensor:
    """Block-diagonal causal attention of one packed row: query [t, heads, d], key / value
    [t, groups, d], sequences delimited by ``params.cu_seqlens_q`` -> context [t, heads, d]."""
    cu_seqlens = params.cu_seqlens_q
    if packed_attention_kernel(query) == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(
            query.contiguous(), key.contiguous(), value.contiguous(),
            cu_seqlens, cu_seqlens, params.max_seqlen_q, params.max_seqlen_q,
            scale=scale, window_size=(-1, 0), enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
    # [t, h, d] -> [1, h, t, d]; each sequence is a contiguous run of t
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    bounds = cu_seqlens.tolist()
    parts = [
        _sdpa(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], None, True, scale)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        if b > a
    ]
    return torch.cat(parts, dim=2)[0].transpose(0, 1)


def _sdpa(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """[b, heads, s, d] from q [b, heads, s, d], k / v [b, groups, s, d]."""
    heads, groups = q.shape[1], k.shape[1]
    gqa = heads != groups
    if gqa and not _takes_gqa(q, k, v, mask, causal):
        k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def _takes_gqa(q, k, v, mask, causal: bool) -> bool:
    """Whether SDPA's kernel for these inputs runs GQA itself: CPU's fused kernel does; on CUDA
    only flash attention does (the others would fall back to the unfused math kernel)."""
    if not q.is_cuda:
        return True
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, causal, True)
    return torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.can_use_flash_attention(
        params
    )
