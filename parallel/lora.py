"""LoRA adapters on megatron-core's tensor-parallel linears, with a frozen base.

rlcli's own adapters: NVIDIA's Megatron-Bridge holds LoRA for Megatron but cannot be installed
next to this stack (it needs Transformer Engine, mamba-ssm and transformers < 5), and PEFT's own
megatron-core support (`LoraConfig(megatron_config=...)`, peft/tuners/lora/tp_layer.py) gives a
fused linear_qkv or linear_fc1 ONE adapter (q, k, v share A: not an HF PEFT adapter), replaces
the linears (their weights become `base_layer.weight`, names that conversion, resharding and
checkpoints address) and has no sharded_state_dict (megatron's dist checkpoints would store its
TP-split tensors as replicated). These compute what HF PEFT's LoRA computes on the HF model
(checked against PEFT by tests/parallel/test_lora.py):

    y = W x + (alpha / r) * B (A dropout(x))       A [r, in] (kaiming-uniform), B [out, r] (zeros)

Public API:

    LORA_TARGET_MODULES                     the Megatron linears that take adapters
    LoraSpec(rank, alpha, dropout=0.0, target_modules=("all",), seed=0)
    LoraConfigError(ValueError)             the message names the actor.lora.* key to change
    lora_modules(hf_config, spec) -> list[LoraModule]   every adapted HF module of the model
    apply_lora(models, spec) -> list[LoraAdapter]       before wrap_for_training
    lora_adapters(models) -> list[LoraAdapter];  lora_spec_of(models) -> LoraSpec | None
    adapter_params(models) -> list[AdapterParam]        this rank's adapter tensors, named
    peft_tensor_name(hf_module, "A" | "B") -> str       PEFT's file name of an adapter tensor
    lora_disabled(models)                   context manager: the base model (the reference)

Each HF module gets its own adapter, as PEFT gives q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj and down_proj one each: Megatron's fused `linear_qkv` carries three (q, k, v), the fused
`linear_fc1` two (gate, up). Sharding follows the layer:

    column-parallel (linear_qkv, linear_fc1): A replicated, B split along its outputs as the
        layer's rows are (for QKV whole query groups; the pieces' outputs are interleaved into
        megatron's per-group [q.., k, v] layout). A's gradient is the sum over TP ranks: the
        low-rank activation A x passes megatron's copy-to-TP region (all-reduce in backward).
    row-parallel (linear_proj, linear_fc2): A split along its inputs as the layer's columns are,
        B replicated; the partial A x is summed over TP ranks (megatron's reduce-from-TP region).

So TP-gathering B (column) or A (row) along the split dimension gives exactly PEFT's tensor.
The adapters are modules beside their linear (`self_attention.linear_qkv_lora`, holding
`q_proj.lora_A`, ...), added to the linear's output by a forward hook; the linear itself is
untouched. Their `sharded_state_dict` marks the split tensors as TP-sharded, so megatron's
distributed checkpoints save every shard. Their parameters carry `is_lora_adapter = True`,
which `parallel.convert.param_mappings` skips (HF conversion is of the base only; adapters
travel through `parallel.reshard.iter_adapter_buckets` / `parallel.lora_io`).

`apply_lora` freezes every base parameter (requires_grad=False) before the caller wraps the
chunks in megatron's DDP: DDP allocates gradient buffers, and `get_megatron_optimizer` builds
state, only for parameters that require grad, so the base gets neither (nor distributed-
optimizer shards). Initialisation draws each full A from a generator seeded by `spec.seed` and
the HF module name, so every layout (TP, PP, DP) starts from the same adapters.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from parallel.convert.mapping import unwrap_chunk
from parallel.convert.registry import get_family
from parallel.model_shapes import (
    LORA_TARGET_MODULES,
    ModelShape,
    layer_lora_targets,
    lora_target_features,
)

# Megatron linear -> (its parent in a TransformerLayer, the rule key of its weight, kind).
_TARGETS = {
    "linear_qkv": ("self_attention", "self_attention.linear_qkv.weight", "column"),
    "linear_proj": ("self_attention", "self_attention.linear_proj.weight", "row"),
    "linear_fc1": ("mlp", "mlp.linear_fc1.weight", "column"),
    "linear_fc2": ("mlp", "mlp.linear_fc2.weight", "row"),
}
_HF_NAMES_HINT = (
    "HF q_proj/k_proj/v_proj are linear_qkv, o_proj is linear_proj, gate_proj/up_proj are "
    "linear_fc1, down_proj is linear_fc2"
)
ADAPTER_SUFFIX = "_lora"  # the adapter of `linear_qkv` is the sibling module `linear_qkv_lora`


def peft_tensor_name(hf_module: str, matrix: str) -> str:
    """The name PEFT saves an adapter tensor under (adapter_model.safetensors), e.g.
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return f"base_model.model.{hf_module}.lora_{matrix}.weight"


class LoraConfigError(ValueError):
    """A LoRA setting or starting adapter that does not fit the model; names the config key."""


@dataclass(frozen=True)
class LoraSpec:
    """rank: r; alpha: scaling numerator (the update is alpha / r * B A); dropout: on the
    adapter's input (training mode only); target_modules: Megatron names or ("all",)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all",)
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets(self) -> tuple[str, ...]:
        """The Megatron linears adapted, in LORA_TARGET_MODULES order (validates the spec)."""
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise LoraConfigError(f"actor.lora.rank={self.rank!r} must be a positive integer")
        if not self.alpha > 0:
            raise LoraConfigError(f"actor.lora.alpha={self.alpha!r} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraConfigError(f"actor.lora.dropout={self.dropout!r} must be in [0, 1)")
        names = tuple(self.target_modules)
        unknown = [n for n in names if n != "all" and n not in LORA_TARGET_MODULES]
        if unknown or not names:
            raise LoraConfigError(
                f"actor.lora.target_modules={list(names)}: "
                + (f"the model has no linear {unknown[0]!r}; " if unknown else "empty; ")
                + f"choose from {', '.join(LORA_TARGET_MODULES)} or 'all' ({_HF_NAMES_HINT})"
            )
        if "all" in names:
            return LORA_TARGET_MODULES
        return tuple(t for t in LORA_TARGET_MODULES if t in names)


@dataclass(frozen=True)
class LoraModule:
    """One adapted HF module: A is [r, in_features], B is [out_features, r] (full shapes)."""

    layer: int  # global layer index
    target: str  # the Megatron linear, e.g. "linear_qkv"
    hf_module: str  # e.g. "model.layers.3.self_attn.q_proj"
    in_features: int
    out_features: int
    parallel: str  # "column" | "row"


def lora_modules(hf_config: Any, spec: LoraSpec) -> list[LoraModule]:
    """Every HF module the spec adapts, layer by layer (pure: from the HF config alone)."""
    family = get_family(hf_config.model_type)
    shape = ModelShape.from_hf_config(hf_config.to_dict())
    modules = []
    for layer in range(hf_config.num_hidden_layers):
        prefix = family.hf_layer_prefix.format(layer=layer)
        for target in layer_lora_targets(shape, layer, spec.targets()):
            names = family.layer_rules[_TARGETS[target][1]].hf_names
            features = lora_target_features(shape, target)
            for name, (fan_in, fan_out, parallel) in zip(names, features, strict=True):
                hf_module = prefix + name.removesuffix(".weight")
                modules.append(LoraModule(layer, target, hf_module, fan_in, fan_out, parallel))
    return modules


class LoraPiece(torch.nn.Module):
    """The adapter of one HF module: this TP rank's lora_A [r, in(/tp)] and lora_B [out(/tp), r]."""

    def __init__(
        self, module: LoraModule, spec: LoraSpec, tp: int, tp_rank: int, like: torch.Tensor
    ) -> None:
        super().__init__()
        self.hf_module = module.hf_module
        full_a = torch.empty(spec.rank, module.in_features, dtype=torch.float32)
        seed = zlib.crc32(f"{spec.seed}:{module.hf_module}".encode())
        # PEFT's default init (init_lora_weights=True): kaiming-uniform A, zero B.
        torch.nn.init.kaiming_uniform_(
            full_a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed)
        )
        column = module.parallel == "column"
        a = full_a if column else full_a.chunk(tp, dim=1)[tp_rank]
        b_rows = module.out_features // tp if column else module.out_features
        kwargs = {"dtype": like.dtype, "device": like.device}
        self.lora_A = torch.nn.Parameter(a.to(**kwargs).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(b_rows, spec.rank, **kwargs))
        # megatron's TP attributes: the gradient norm counts a replicated tensor once, and
        # sharded tensors are gathered / checkpointed along partition_dim.
        set_tensor_model_parallel_attributes(self.lora_A, not column, 1, 1)
        set_tensor_model_parallel_attributes(self.lora_B, column, 0, 1)
        for param in (self.lora_A, self.lora_B):
            param.is_lora_adapter = True


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear; `delta(x)` is what the forward hook adds.

    Column-parallel: x [s, b, in] -> delta [s, b, out/tp] in the linear's local output layout.
    Row-parallel: x [s, b, in/tp] (this rank's input shard) -> delta [s, b, out] (after the
    TP sum, like the linear's own output).
    """

    def __init__(
        self, linear: Any, target: str, modules: list[LoraModule], spec: LoraSpec, name: str
    ) -> None:
        super().__init__()
        self.target, self.linear_name = target, name
        self.parallel = modules[0].parallel
        self.scaling, self.dropout, self.rank = spec.scaling, spec.dropout, spec.rank
        self.tp_group = linear.tp_group
        self.enabled = True
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        for m in modules:  # children named by HF module: linear_qkv_lora.q_proj.lora_A, ...
            self.add_module(
                m.hf_module.rpartition(".")[2], LoraPiece(m, spec, tp, tp_rank, linear.weight)
            )
        self.query_groups = linear.config.num_query_groups // tp  # linear_qkv only
        self.output_gate = bool(linear.config.attention_output_gate)  # Qwen3.5's gated q_proj

    @property
    def pieces(self) -> dict[str, LoraPiece]:
        """The adapters of the linear's HF modules, in the linear's output order."""
        return dict(self.named_children())

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        pieces = list(self.pieces.values())
        if self.parallel == "row":
            if self.dropout and self.training:
                with get_cuda_rng_tracker().fork():  # the input is TP-split: per-rank masks
                    x = F.dropout(x, self.dropout)
            low = reduce_from_tensor_model_parallel_region(
                F.linear(x, pieces[0].lora_A), group=self.tp_group
            )
            return F.linear(low, pieces[0].lora_B) * self.scaling
        # One low-rank activation [s, b, pieces * r] through one TP region: one all-reduce of
        # A's input gradient in backward. Each piece draws its own dropout mask, as PEFT's
        # separate modules do; x is replicated, so the (shared) default stream keeps TP ranks
        # alike.
        dropped = self.dropout and self.training
        low = torch.cat(
            [F.linear(F.dropout(x, self.dropout) if dropped else x, p.lora_A) for p in pieces],
            dim=-1,
        )
        low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
        outs = [
            F.linear(h, p.lora_B) for h, p in zip(low.split(self.rank, -1), pieces, strict=True)
        ]
        if self.target == "linear_qkv":  # per query group: [its q heads, (their gates,) k, v]
            groups = self.query_groups
            outs = [o.unflatten(-1, (groups, -1)) for o in outs]
            if self.output_gate:  # HF's q_proj rows: each head's query, then its gate
                head_dim = outs[1].shape[-1]
                query_and_gate = outs[0].unflatten(-1, (-1, 2, head_dim))
                outs[0] = query_and_gate.transpose(-3, -2).flatten(-3)
            return torch.cat(outs, dim=-1).flatten(-2) * self.scaling
        return torch.cat(outs, dim=-1) * self.scaling  # linear_fc1's shard is [gate; up]

    def hook(self, module, args, kwargs, output):
        """Forward hook of the linear: (output, bias) -> (output + delta, bias)."""
        if not self.enabled:
            return output
        result, bias = output
        x = args[0] if args else kwargs["input_"]
        return result + self.delta(x), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron dist-checkpoint entries: B TP-sharded along dim 0 (column) or A along dim 1
        (row), the other replicated (full shapes: readable at any TP)."""
        split = "lora_B" if self.parallel == "column" else "lora_A"
        axis = {f"{key}.{split}": 0 if split == "lora_B" else 1 for key in self.pieces}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _require_grad(module, args, output: torch.Tensor) -> torch.Tensor:
    # With full activation recomputation megatron checkpoints each layer block with an
    # autograd Function: if its input needs no gradient (a frozen embedding's output), neither
    # does its output, and the adapters inside get no gradient at all (Megatron-Bridge #1750).
    return output if output.requires_grad else output.requires_grad_(True)


def apply_lora(models: Sequence[torch.nn.Module], spec: LoraSpec) -> list[LoraAdapter]:
    """Freeze every base parameter of the bare chunks (`build_model`'s) and add adapters to the
    target linears of each layer; returns this rank's adapters. Call before
    `parallel.optim.wrap_for_training`, after loading the base weights."""
    targets = spec.targets()
    adapters = []
    for chunk in models:
        if unwrap_chunk(chunk) is not chunk:
            raise ValueError("apply_lora takes the bare chunks: call it before wrap_for_training")
        if getattr(chunk, "lora_spec", None) is not None:
            raise ValueError("apply_lora was already applied to these chunks")
        chunk.requires_grad_(False)
        by_layer: dict[int, list[LoraModule]] = {}
        for module in lora_modules(chunk.hf_config, spec):
            by_layer.setdefault(module.layer, []).append(module)
        for layer in chunk.decoder.layers:
            index = layer.layer_number - 1
            for target in targets:
                modules = [m for m in by_layer[index] if m.target == target]
                if not modules:  # a Gated DeltaNet layer: no attention linears to adapt
                    continue
                parent_name = _TARGETS[target][0]
                parent = getattr(layer, parent_name)
                linear = getattr(parent, target, None)
                _check_linear(linear, target)
                name = f"decoder.layers.{index}.{parent_name}.{target}"
                adapter = LoraAdapter(linear, target, modules, spec, name)
                parent.add_module(target + ADAPTER_SUFFIX, adapter)
                linear.register_forward_hook(adapter.hook, with_kwargs=True)
                adapters.append(adapter)
        if chunk.pre_process and chunk.config.recompute_granularity == "full":
            chunk.embedding.register_forward_hook(_require_grad)
        chunk.lora_spec = spec
    return adapters


def _check_linear(linear: Any, target: str) -> None:
    kinds = {"column": ColumnParallelLinear, "row": RowParallelLinear}
    kind = kinds[_TARGETS[target][2]]
    if linear is None:
        raise LoraConfigError(
            f"actor.lora.target_modules: the model's layers have no {target!r}; "
            f"choose from {', '.join(LORA_TARGET_MODULES)}"
        )
    if type(linear) is not kind:
        # Transformer Engine's fused norm + linear layers hold the norm inside the linear: an
        # adapter on their input would see the un-normed activations.
        raise LoraConfigError(
            f"actor.lora needs megatron's local layers ({target} is {type(linear).__name__}, "
            f"not {kind.__name__}): set model.transformer_impl=local"
        )
    if getattr(linear, "gather_output", False) or getattr(linear, "sequence_parallel", False):
        raise LoraConfigError(
            f"actor.lora: {target} gathers its output or is sequence-parallel, which the "
            "adapters do not support; set parallel.sequence_parallel=false"
        )


def lora_adapters(models: Sequence[torch.nn.Module]) -> list[LoraAdapter]:
    """This rank's adapters, in chunk and layer order (bare or DDP-wrapped chunks)."""
    return [
        m for chunk in models for m in unwrap_chunk(chunk).modules() if isinstance(m, LoraAdapter)
    ]


def lora_spec_of(models: Sequence[torch.nn.Module]) -> LoraSpec | None:
    """The spec `apply_lora` was called with, None for a model without adapters."""
    return getattr(unwrap_chunk(models[0]), "lora_spec", None)


@contextmanager
def lora_disabled(models: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside, the chunks compute the base model (the reference policy of a LoRA actor); the
    adapters stay where they are and come back on exit."""
    adapters = lora_adapters(models)
    previous = [adapter.enabled for adapter in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, enabled in zip(adapters, previous, strict=True):
            adapter.enabled = enabled


@dataclass(frozen=True)
class AdapterParam:
    """One local adapter tensor, named as every rank of the pipeline names it."""

    global_name: str  # e.g. decoder.layers.3.self_attention.linear_qkv_lora.q_proj.lora_A
    param: torch.nn.Parameter
    partition_dim: int | None  # None: replicated over TP
    linear_name: str  # the Megatron linear it adapts: decoder.layers.3.self_attention.linear_qkv
    hf_module: str  # model.layers.3.self_attn.q_proj
    matrix: str  # "A" | "B"


def adapter_params(models: Sequence[torch.nn.Module]) -> list[AdapterParam]:
    """This rank's adapter tensors, per linear in model order, A before B for each piece."""
    params = []
    for adapter in lora_adapters(models):
        for key, piece in adapter.pieces.items():
            for matrix in ("A", "B"):
                param = getattr(piece, f"lora_{matrix}")
                params.append(
                    AdapterParam(
                        global_name=f"{adapter.linear_name}{ADAPTER_SUFFIX}.{key}.lora_{matrix}",
                        param=param,
                        partition_dim=param.partition_dim if param.tensor_model_parallel else None,
                        linear_name=adapter.linear_name,
                        hf_module=piece.hf_module,
                        matrix=matrix,
                    )
                )
    return params
