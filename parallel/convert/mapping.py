"""Per-parameter HF <-> Megatron mapping for the parameters a rank holds.

Public API (stable; the bucketed resharder in rlcli builds on it):

    ParamMapping: frozen dataclass, one per local Megatron parameter
        chunk_index   index into the list of model chunks (virtual pipeline stage)
        local_name    name inside the chunk (`chunk.named_parameters()`; layer indices local)
        global_name   same with global layer (and global expert) indices (identical on every
                      rank holding it)
        param         the local torch.nn.Parameter (this TP rank's shard)
        partition_dim TP split dimension (megatron's `param.partition_dim`), None if replicated
        hf_names      the HF tensors this parameter is made of
        skip_export   True for a tied output layer (HF stores only model.embed_tokens)
        expert        True for a routed expert's weight: held by one expert-parallel rank only,
                      split over the expert-tensor-parallel group (not the TP group)
        to_hf(full)   -> list[(hf_name, tensor)]: `full` is the TP-gathered Megatron tensor,
                      i.e. torch.cat(shards in TP-rank order, dim=partition_dim) (the local
                      param itself when partition_dim is None); expert-TP shards for experts.
                      Splits fused QKV / gate-up, drops vocab padding.
        shard_from_hf(read) -> tensor shaped like `param`: this TP rank's shard built from HF
                      tensors; read(hf_name, dim, start, stop) returns rows/cols [start, stop)
                      along dim (dim=None: the whole tensor).
    param_mappings(models, hf_config, tp, tp_rank, *, etp=None, etp_rank=None, ep=1, ep_rank=0)
        -> list[ParamMapping]   (etp / etp_rank: expert tensor parallel, default tp / tp_rank;
        the base weights only: LoRA adapters, parameters marked `is_lora_adapter`, are skipped)
    hf_rule(hf_config, global_name) -> (Rule, skip_export)   (HF names of that one parameter)
    stored_shifted(hf_config, hf_name) -> bool   (held as 1 + w: a zero-centred norm)
    megatron_to_hf(hf_config, tp, global_name, full, *, etp=None) -> list[(hf_name, tensor)]
        (works on ranks that do not hold the parameter: needs only its global name)
    renumber_expert(global_name, offset) -> str   (the same weight of another routed expert)

Layouts (megatron-core GPTModel):
    linear_qkv  [ng * (q_per_group + 2) * d, h]: for each KV group g, its q heads, then k_g, v_g;
                TP splits whole groups (rank r holds groups [r*ng/tp, (r+1)*ng/tp)). With an
                output gate (`gated_qkv`) each group holds its q heads, their gates, k_g, v_g.
    DeltaNet    Gated DeltaNet's in_proj (q, k, v, z, beta, alpha) and conv1d (q, k, v): TP
                shard r is [part_0 heads r; part_1 heads r; ...] (`delta_net_layout`).
    linear_fc1  TP shard r is [gate rows r; up rows r], so the TP-gathered tensor is
                [gate_0; up_0; gate_1; up_1; ...] (a routed expert's: over expert TP).
    vocab       rows [r*Vp/tp, (r+1)*Vp/tp) on TP rank r; rows >= V are padding (zeros).
    experts     EP rank r holds experts [r*E/ep, (r+1)*E/ep) as local experts 0 .. E/ep - 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from parallel.convert.delta_net_layout import (
    DELTA_NET_KINDS,
    delta_net_parts,
    parts_shard,
    parts_to_hf,
)
from parallel.convert.registry import Rule, get_family
from parallel.vocab import padded_vocab_size

# Critic head: generic, not family-specific.
VALUE_HEAD_RULES = {
    "output_layer.value.weight": Rule("copy", ("score.weight",)),
    "output_layer.value.bias": Rule("copy", ("score.bias",)),
}

Reader = Callable[[str, int | None, int, int], torch.Tensor]
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# A routed expert's index inside a layer name: SequentialMLP's module list, or TE's grouped
# GEMM weights (one per local expert). Rules name it `{expert}`.
_EXPERT_INDEX = (
    re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$"),
    re.compile(r"^(mlp\.experts\.linear_fc[12]\.weight)(\d+)()$"),
)


def _expert_template(layer_suffix: str) -> tuple[str, int | None]:
    """(the suffix with its expert index replaced by `{expert}`, the index), or (suffix, None)."""
    for pattern in _EXPERT_INDEX:
        match = pattern.match(layer_suffix)
        if match:
            return f"{match.group(1)}{{expert}}{match.group(3)}", int(match.group(2))
    return layer_suffix, None


@dataclass(frozen=True)
class _Geometry:
    tp: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
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
    expert: bool
    to_hf: Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]]
    shard_from_hf: Callable[[Reader], torch.Tensor]


def _qkv_to_hf(full: torch.Tensor, names: tuple[str, ...], geo: _Geometry, gated: bool = False):
    """``gated``: each group also holds its heads' output gates after its queries; HF's q_proj
    then holds each head's query rows followed by its gate rows."""
    per_group = geo.num_heads // geo.num_kv_heads
    queries = 2 * per_group if gated else per_group
    rest = full.shape[1:]
    grouped = full.reshape(geo.num_kv_heads, queries + 2, geo.head_dim, *rest)
    q = grouped[:, :queries]
    if gated:  # [queries; gates] -> per head [query; gate]
        q = q.unflatten(1, (2, per_group)).transpose(1, 2)
    k = grouped[:, queries].reshape(-1, *rest)
    v = grouped[:, queries + 1].reshape(-1, *rest)
    return list(zip(names, (q.reshape(-1, *rest), k, v), strict=True))


def _qkv_shard(
    read: Reader, names: tuple[str, ...], geo: _Geometry, tp_rank: int, gated: bool = False
):
    groups = geo.num_kv_heads // geo.tp
    per_group = geo.num_heads // geo.num_kv_heads
    d = geo.head_dim
    first = tp_rank * groups
    q_rows = (2 if gated else 1) * per_group * d  # per group: its heads' (query, gate) rows
    q = read(names[0], 0, first * q_rows, (first + groups) * q_rows)
    k = read(names[1], 0, first * d, (first + groups) * d)
    v = read(names[2], 0, first * d, (first + groups) * d)
    rest = q.shape[1:]
    if gated:  # per head [query; gate] -> [queries; gates]
        q = q.reshape(groups, per_group, 2, d, *rest).transpose(1, 2)
    q = q.reshape(groups, -1, d, *rest)
    k = k.reshape(groups, 1, d, *rest)
    v = v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _gate_up_to_hf(full: torch.Tensor, names: tuple[str, ...], ffn: int, tp: int):
    per_rank = full.reshape(tp, 2, ffn // tp, *full.shape[1:])
    gate = per_rank[:, 0].reshape(ffn, *full.shape[1:])
    up = per_rank[:, 1].reshape(ffn, *full.shape[1:])
    return [(names[0], gate), (names[1], up)]


def _gate_up_shard(read: Reader, names: tuple[str, ...], ffn: int, tp: int, tp_rank: int):
    rows = ffn // tp
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
        suffix, expert = _expert_template(match.group(2))
        rule = family.layer_rules.get(suffix)
        prefix = family.hf_layer_prefix.format(layer=int(match.group(1)))
        if rule is not None:
            names = tuple(prefix + name.replace("{expert}", str(expert)) for name in rule.hf_names)
            rule = rule._replace(hf_names=names, expert=expert is not None)
    else:
        rule = VALUE_HEAD_RULES.get(global_name) or family.global_rules.get(global_name)
    for prefix, hf_prefix in family.module_prefixes.items():
        if rule is None and global_name.startswith(prefix):
            rule = Rule("copy", (hf_prefix + global_name.removeprefix(prefix),))
    if rule is None:
        raise KeyError(
            f"no {family.name} conversion rule for Megatron parameter {global_name!r}; "
            f"add it to parallel/convert/{family.name}.py"
        )
    if global_name == "output_layer.weight" and getattr(hf_config, "tie_word_embeddings", False):
        # Tied head on the last stage of a pipeline: a copy of the embedding, not exported.
        return family.global_rules["embedding.word_embeddings.weight"], True
    return rule, False


def stored_shifted(hf_config: Any, hf_name: str) -> bool:
    """Whether Megatron holds this HF tensor as 1 + w (a zero-centred norm, rule `plus_one`):
    exported, it equals the HF tensor up to that addition's rounding, not bit for bit."""
    family = get_family(hf_config.model_type)
    rules = [*family.layer_rules.values(), *family.global_rules.values()]
    shifted = {name for rule in rules if rule.kind == "plus_one" for name in rule.hf_names}
    return any(hf_name == name or hf_name.endswith("." + name) for name in shifted)


def megatron_to_hf(
    hf_config: Any, tp: int, global_name: str, full: torch.Tensor, *, etp: int | None = None
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one TP-gathered (expert-TP-gathered: `etp`, default tp) Megatron tensor
    (see ParamMapping.to_hf)."""
    rule, _ = hf_rule(hf_config, global_name)
    geo = _Geometry.from_hf(hf_config, tp)
    if rule.kind in ("qkv", "gated_qkv"):
        return _qkv_to_hf(full, rule.hf_names, geo, gated=rule.kind == "gated_qkv")
    if rule.kind in DELTA_NET_KINDS:
        return parts_to_hf(full, delta_net_parts(rule.kind, rule.hf_names, hf_config), tp)
    if rule.kind == "plus_one":
        return [(rule.hf_names[0], full - 1)]
    if rule.kind == "gate_up":
        split = (etp or tp) if rule.expert else tp
        return _gate_up_to_hf(full, rule.hf_names, getattr(hf_config, rule.ffn), split)
    if rule.kind == "vocab":
        return [(rule.hf_names[0], full[: geo.vocab])]
    return [(rule.hf_names[0], full)]


def _shard_from_hf(
    read: Reader,
    rule: Rule,
    geo: _Geometry,
    tp_rank: int,
    dim: int | None,
    like: torch.Tensor,
    ffn: int,
    split: tuple[int, int],
    hf_config: Any,
) -> torch.Tensor:
    """`split`: (TP size, TP rank) of this parameter's group (expert TP for routed experts)."""
    if rule.kind in ("qkv", "gated_qkv"):
        return _qkv_shard(read, rule.hf_names, geo, tp_rank, gated=rule.kind == "gated_qkv")
    if rule.kind in DELTA_NET_KINDS:
        return parts_shard(read, delta_net_parts(rule.kind, rule.hf_names, hf_config), *split)
    if rule.kind == "plus_one":
        return _copy_shard(read, rule.hf_names[0], dim, split[1], like) + 1
    if rule.kind == "gate_up":
        return _gate_up_shard(read, rule.hf_names, ffn, *split)
    if rule.kind == "vocab":
        return _vocab_shard(read, rule.hf_names[0], geo, tp_rank, like)
    return _copy_shard(read, rule.hf_names[0], dim, split[1], like)


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers (each keeps it as .module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def renumber_expert(global_name: str, offset: int) -> str:
    """The global name of the same weight of the expert `offset` places further (a routed
    expert's weight; the same expert on another EP rank is `offset = k * E/ep` away)."""
    match = _LAYER_NAME.match(global_name)
    suffix, expert = _expert_template(match.group(2)) if match else (global_name, None)
    if expert is None:
        raise ValueError(f"{global_name} is not a routed expert's weight")
    return f"decoder.layers.{match.group(1)}.{suffix.replace('{expert}', str(expert + offset))}"


def _global_name(chunk: torch.nn.Module, local_name: str, expert_offset: int) -> str:
    """`local_name` with the chunk-local layer index replaced by the global one, and a local
    expert index by the global one (`expert_offset`: the first expert of this EP rank)."""
    match = _LAYER_NAME.match(local_name)
    if not match:
        return local_name
    layer = chunk.decoder.layers[int(match.group(1))].layer_number - 1
    suffix, expert = _expert_template(match.group(2))
    if expert is not None:
        suffix = suffix.replace("{expert}", str(expert_offset + expert))
    return f"decoder.layers.{layer}.{suffix}"


def param_mappings(
    models: Iterable[torch.nn.Module],
    hf_config: Any,
    tp: int,
    tp_rank: int,
    *,
    etp: int | None = None,
    etp_rank: int | None = None,
    ep: int = 1,
    ep_rank: int = 0,
) -> list[ParamMapping]:
    """One ParamMapping per parameter of the (unwrapped or DDP-wrapped) chunks, in chunk order.
    `etp`, `etp_rank`: expert tensor parallelism (default: tp, tp_rank); `ep`, `ep_rank`:
    expert parallelism (this rank holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep))."""
    geo = _Geometry.from_hf(hf_config, tp)
    etp, etp_rank = etp or tp, tp_rank if etp_rank is None else etp_rank
    expert_offset = ep_rank * (getattr(hf_config, "num_experts", 0) or 0) // ep
    mappings = []
    for chunk_index, chunk in enumerate(models):
        chunk = unwrap_chunk(chunk)
        for local_name, param in chunk.named_parameters():
            if getattr(param, "is_lora_adapter", False):
                continue  # parallel.lora's adapters are not HF weights (parallel.lora_io)
            global_name = _global_name(chunk, local_name, expert_offset)
            rule, skip_export = hf_rule(hf_config, global_name)
            # megatron's GatedDeltaNet marks conv1d, A_log and dt_bias TP-split without a
            # partition_dim: they are split along their first dimension
            split_dim = getattr(param, "partition_dim", 0)
            dim = split_dim if getattr(param, "tensor_model_parallel", False) else None
            split = (etp, etp_rank) if rule.expert else (tp, tp_rank)
            mappings.append(
                ParamMapping(
                    chunk_index=chunk_index,
                    local_name=local_name,
                    global_name=global_name,
                    param=param,
                    partition_dim=dim,
                    hf_names=rule.hf_names,
                    skip_export=skip_export,
                    expert=rule.expert,
                    to_hf=partial(megatron_to_hf, hf_config, tp, global_name, etp=etp),
                    shard_from_hf=partial(
                        _shard_from_hf,
                        rule=rule,
                        geo=geo,
                        tp_rank=tp_rank,
                        dim=dim,
                        like=param,
                        ffn=getattr(hf_config, rule.ffn, 0),
                        split=split,
                        hf_config=hf_config,
                    ),
                )
            )
    return mappings
