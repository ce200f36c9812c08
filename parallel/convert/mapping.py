"""Per-parameter HF <-> Megatron mapping for the parameters a rank holds.

Public API (stable; the bucketed resharder in rlcli builds on it):

    ParamMapping: frozen dataclass, one per local Megatron parameter
        chunk_index   index into the list of model chunks (virtual pipeline stage)
        local_name    name inside the chunk (`chunk.named_parameters()`; layer indices local)
        global_name   same with global layer indices (identical on every rank holding it)
        param         the local torch.nn.Parameter (this TP rank's shard)
        partition_dim TP split dimension (megatron's `param.partition_dim`), None if replicated
        hf_names      the HF tensors this parameter is made of
        skip_export   True for a tied output layer (HF stores only model.embed_tokens)
        to_hf(full)   -> list[(hf_name, tensor)]: `full` is the TP-gathered Megatron tensor,
                      i.e. torch.cat(shards in TP-rank order, dim=partition_dim) (the local
                      param itself when partition_dim is None). Splits fused QKV / gate-up,
                      drops vocab padding.
        shard_from_hf(read) -> tensor shaped like `param`: this TP rank's shard built from HF
                      tensors; read(hf_name, dim, start, stop) returns rows/cols [start, stop)
                      along dim (dim=None: the whole tensor).
    param_mappings(models, hf_config, tp, tp_rank) -> list[ParamMapping]
        (the base weights only: LoRA adapters, parameters marked `is_lora_adapter`, are skipped)
    hf_rule(hf_config, global_name) -> (Rule, skip_export)
    megatron_to_hf(hf_config, tp, global_name, full) -> list[(hf_name, tensor)]
        (works on ranks that do not hold the parameter: needs only its global name)

Layouts (megatron-core GPTModel):
    linear_qkv  [ng * (q_per_group + 2) * d, h]: for each KV group g, its q heads, then k_g, v_g;
                TP splits whole groups (rank r holds groups [r*ng/tp, (r+1)*ng/tp)).
    linear_fc1  TP shard r is [gate rows r; up rows r], so the TP-gathered tensor is
                [gate_0; up_0; gate_1; up_1; ...].
    vocab       rows [r*Vp/tp, (r+1)*Vp/tp) on TP rank r; rows >= V are padding (zeros).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from parallel.convert.registry import Rule, get_family
from parallel.vocab import padded_vocab_size

# Critic head: generic, not family-specific.
VALUE_HEAD_RULES = {
    "output_layer.value.weight": Rule("copy", ("score.weight",)),
    "output_layer.value.bias": Rule("copy", ("score.bias",)),
}

Reader = Callable[[str, int | None, int, int], torch.Tensor]
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Geometry:
    tp: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int

    @classmethod
    def from_hf(cls, hf_config: Any, tp: int) -> _Geometry:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            tp=tp,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            ffn=hf_config.intermediate_size,
            vocab=hf_config.vocab_size,
            padded_vocab=padded_vocab_size(hf_config.vocab_size, tp),
        )


@dataclass(frozen=True)
class ParamMapping:
    chunk_index: int
    local_name: str
    global_name: str
    param: torch.nn.Parameter
    partition_dim: int | None
    hf_names: tuple[str, ...]
    skip_export: bool
    to_hf: Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]]
    shard_from_hf: Callable[[Reader], torch.Tensor]


def _qkv_to_hf(full: torch.Tensor, names: tuple[str, ...], geo: _Geometry):
    per_group = geo.num_heads // geo.num_kv_heads
    rest = full.shape[1:]
    grouped = full.reshape(geo.num_kv_heads, per_group + 2, geo.head_dim, *rest)
    q = grouped[:, :per_group].reshape(-1, *rest)
    k = grouped[:, per_group].reshape(-1, *rest)
    v = grouped[:, per_group + 1].reshape(-1, *rest)
    return list(zip(names, (q, k, v), strict=True))


def _qkv_shard(read: Reader, names: tuple[str, ...], geo: _Geometry, tp_rank: int):
    groups = geo.num_kv_heads // geo.tp
    per_group = geo.num_heads // geo.num_kv_heads
    d = geo.head_dim
    first = tp_rank * groups
    q = read(names[0], 0, first * per_group * d, (first + groups) * per_group * d)
    k = read(names[1], 0, first * d, (first + groups) * d)
    v = read(names[2], 0, first * d, (first + groups) * d)
    rest = q.shape[1:]
    q = q.reshape(groups, per_group, d, *rest)
    k = k.reshape(groups, 1, d, *rest)
    v = v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _gate_up_to_hf(full: torch.Tensor, names: tuple[str, ...], geo: _Geometry):
    per_rank = full.reshape(geo.tp, 2, geo.ffn // geo.tp, *full.shape[1:])
    gate = per_rank[:, 0].reshape(geo.ffn, *full.shape[1:])
    up = per_rank[:, 1].reshape(geo.ffn, *full.shape[1:])
    return [(names[0], gate), (names[1], up)]


def _gate_up_shard(read: Reader, names: tuple[str, ...], geo: _Geometry, tp_rank: int):
    rows = geo.ffn // geo.tp
    start = tp_rank * rows
    return torch.cat(
        [read(names[0], 0, start, start + rows), read(names[1], 0, start, start + rows)]
    )


def _vocab_shard(read: Reader, name: str, geo: _Geometry, tp_rank: int, like: torch.Tensor):
    rows = geo.padded_vocab // geo.tp
    start = tp_rank * rows
    stop = min(start + rows, geo.vocab)
    shard = torch.zeros(like.shape, dtype=like.dtype)
    if stop > start:
        shard[: stop - start] = read(name, 0, start, stop)
    return shard


def _copy_shard(read: Reader, name: str, dim: int | None, tp_rank: int, like: torch.Tensor):
    if dim is None:
        return read(name, None, 0, 0)
    size = like.shape[dim]
    return read(name, dim, tp_rank * size, (tp_rank + 1) * size)


def hf_rule(hf_config: Any, global_name: str) -> tuple[Rule, bool]:
    """(Rule with full HF names, skip_export) for a global Megatron parameter name."""
    family = get_family(hf_config.model_type)
    match = _LAYER_NAME.match(global_name)
    if match:
        rule = family.layer_rules.get(match.group(2))
        prefix = family.hf_layer_prefix.format(layer=int(match.group(1)))
        rule = rule and Rule(rule.kind, tuple(prefix + name for name in rule.hf_names))
    else:
        rule = VALUE_HEAD_RULES.get(global_name) or family.global_rules.get(global_name)
    if rule is None:
        raise KeyError(
            f"no {family.name} conversion rule for Megatron parameter {global_name!r}; "
            f"add it to parallel/convert/{family.name}.py"
        )
    if global_name == "output_layer.weight" and getattr(hf_config, "tie_word_embeddings", False):
        # Tied head on the last stage of a pipeline: a copy of the embedding, not exported.
        return family.global_rules["embedding.word_embeddings.weight"], True
    return rule, False


def megatron_to_hf(
    hf_config: Any, tp: int, global_name: str, full: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one TP-gathered Megatron tensor (see ParamMapping.to_hf)."""
    rule, _ = hf_rule(hf_config, global_name)
    geo = _Geometry.from_hf(hf_config, tp)
    if rule.kind == "qkv":
        return _qkv_to_hf(full, rule.hf_names, geo)
    if rule.kind == "gate_up":
        return _gate_up_to_hf(full, rule.hf_names, geo)
    if rule.kind == "vocab":
        return [(rule.hf_names[0], full[: geo.vocab])]
    return [(rule.hf_names[0], full)]


def _shard_from_hf(
    read: Reader, rule: Rule, geo: _Geometry, tp_rank: int, dim: int | None, like: torch.Tensor
) -> torch.Tensor:
    if rule.kind == "qkv":
        return _qkv_shard(read, rule.hf_names, geo, tp_rank)
    if rule.kind == "gate_up":
        return _gate_up_shard(read, rule.hf_names, geo, tp_rank)
    if rule.kind == "vocab":
        return _vocab_shard(read, rule.hf_names[0], geo, tp_rank, like)
    return _copy_shard(read, rule.hf_names[0], dim, tp_rank, like)


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers (each keeps it as .module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _global_name(chunk: torch.nn.Module, local_name: str) -> str:
    """`local_name` with the chunk-local layer index replaced by the global one."""
    match = _LAYER_NAME.match(local_name)
    if not match:
        return local_name
    layer = chunk.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{match.group(2)}"


def param_mappings(
    models: Iterable[torch.nn.Module], hf_config: Any, tp: int, tp_rank: int
) -> list[ParamMapping]:
    """One ParamMapping per parameter of the (unwrapped or DDP-wrapped) chunks, in chunk order."""
    geo = _Geometry.from_hf(hf_config, tp)
    mappings = []
    for chunk_index, chunk in enumerate(models):
        chunk = unwrap_chunk(chunk)
        for local_name, param in chunk.named_parameters():
            if getattr(param, "is_lora_adapter", False):
                continue  # parallel.lora's adapters are not HF weights (parallel.lora_io)
            global_name = _global_name(chunk, local_name)
            rule, skip_export = hf_rule(hf_config, global_name)
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            mappings.append(
                ParamMapping(
                    chunk_index=chunk_index,
                    local_name=local_name,
                    global_name=global_name,
                    param=param,
                    partition_dim=dim,
                    hf_names=rule.hf_names,
                    skip_export=skip_export,
                    to_hf=partial(megatron_to_hf, hf_config, tp, global_name),
                    shard_from_hf=partial(
                        _shard_from_hf, rule=rule, geo=geo, tp_rank=tp_rank, dim=dim, like=param
                    ),
                )
            )
    return mappings
