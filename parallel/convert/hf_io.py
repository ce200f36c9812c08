"""Load HF safetensors into Megatron shards; gather Megatron shards back into HF tensors.

Public API (stable):

    load_hf_weights(models, mesh, hf_dir) -> None
        Every rank reads only its own TP / PP shards (`safe_open(...).get_slice`). Call it on the
        plain chunks from `parallel.model.build_model`, before wrapping them in DDP and
        building the optimizer (those copy the weights). A critic's value head (`score.*`) keeps
        its initialisation when the checkpoint has none; any other missing tensor is an error.
    iter_hf_weights(models, mesh, hf_config=None) -> Iterator[(hf_name, full_tensor)]
        Collective: every rank of the job must iterate it to the end, and every rank gets every
        HF tensor, one at a time (TP all-gather inside the TP group, for routed experts inside
        the expert-TP group and then across the expert-parallel group, then a broadcast from
        the owning pipeline stage inside the PP group). Tensors are on `cpu_compat.device()`, in the
        model's dtype. The simple per-tensor path: export, tests, and the "naive" baseline for
        the bucketed resharder.
    hf_model_dir_problem(hf_dir) -> str | None
        Why a folder would not load (no config.json, unsupported family, no safetensors).
    save_hf_checkpoint(models, mesh, out_dir, hf_config, tokenizer_dir=None) -> None
        Collective. Rank 0 writes safetensors (one file, or shards of <= 4 GiB plus
        model.safetensors.index.json) and config.json, and copies the tokenizer files of
        `tokenizer_dir` when given.

`hf_config` defaults to the config `build_model` attached to the chunks.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.convert.mapping import (
    ParamMapping,
    megatron_to_hf,
    param_mappings,
    renumber_expert,
    unwrap_chunk,
)
from parallel.convert.registry import multimodal_parts
from parallel.cpu_compat import device

if TYPE_CHECKING:
    from parallel.mesh import Mesh

MAX_SHARD_BYTES = 4 * 1024**3
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    # a vision-language model's image / video processors (older and newer layouts)
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


class HFCheckpointReader:
    """Reads (slices of) tensors from an HF safetensors checkpoint, single-file or sharded.

    Called as reader(name, dim, start, stop): rows (dim 0) or columns (dim 1) [start, stop) of
    tensor `name`, or the whole tensor for dim=None. Only the requested bytes are read.
    """

    def __init__(self, hf_dir: str | Path, stack: ExitStack) -> None:
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in HF model directory {hf_dir}")
        self._handles = {
            name: stack.enter_context(safe_open(hf_dir / name, framework="pt")) for name in files
        }
        if weight_map is None:
            weight_map = {key: name for name, f in self._handles.items() for key in f.keys()}
        self.weight_map: dict[str, str] = weight_map
        self.hf_dir = hf_dir

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __call__(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        handle = self._handles[self.weight_map[name]]
        if dim is None:
            return handle.get_tensor(name)
        tensor_slice = handle.get_slice(name)
        return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]


def _hf_config_of(models: Sequence[torch.nn.Module], hf_config: Any) -> Any:
    """The config the chunks were built from: a vision-language checkpoint's language model's."""
    if hf_config is not None:
        return multimodal_parts(hf_config)[0]
    return unwrap_chunk(models[0]).hf_config


def hf_model_dir_problem(hf_dir: str | Path) -> str | None:
    """What keeps `hf_dir` from loading into Megatron, in words, or None when it looks loadable:
    no config.json, a `model_type` with no family in `parallel/convert/`, or no safetensors
    weights (PyTorch ``*.bin`` files are not read: they are pickles)."""
    from parallel.convert.registry import language_model_type, supported_model_types

    path = Path(hf_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        return f"{path} is not a HuggingFace model directory (no config.json)"
    try:
        config = json.loads(config_file.read_text())
        model_type = config.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        return f"{config_file} is not a JSON object: {error}"
    text_type = language_model_type(config)
    if text_type is not None:
        return (
            f"{config_file} is a multimodal checkpoint (model_type {model_type!r}) around a "
            f"{text_type} language model, which rlcli trains on its own: take it out once with "
            f"`rlcli convert language-model --model {path} --out {path}-text` and use that folder"
        )
    supported = supported_model_types()
    if model_type not in supported:
        return (
            f"{config_file} has model_type {model_type!r}, which has no weight mapping; "
            f"supported model families: {', '.join(supported)} (a new family is one file in "
            "parallel/convert/)"
        )
    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")):
            return (
                f"{path} has only PyTorch *.bin weights; rlcli reads safetensors. Convert once "
                'with: python -c "from transformers import AutoModelForCausalLM as M; '
                f"M.from_pretrained('{path}').save_pretrained('{path}')\""
            )
        return f"{path} has no *.safetensors weights"
    return None


def mesh_mappings(
    models: Sequence[torch.nn.Module], hf_config: Any, mesh: Mesh
) -> list[ParamMapping]:
    """`param_mappings` for this rank's place in `mesh` (TP, expert TP and EP ranks)."""
    return param_mappings(
        models,
        hf_config,
        mesh.tp,
        mesh.tp_rank,
        etp=mesh.etp,
        etp_rank=mesh.etp_rank,
        ep=mesh.ep,
        ep_rank=mesh.ep_rank,
    )


def _load_hf_config(hf_dir: str | Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir)


@torch.no_grad()
def load_hf_weights(
    models: Sequence[torch.nn.Module], mesh: Mesh, hf_dir: str | Path, hf_config: Any = None
) -> None:
    """Fill this rank's Megatron shards from the HF checkpoint in `hf_dir` (module docstring)."""
    built_for = getattr(unwrap_chunk(models[0]), "hf_config", None)
    hf_config = multimodal_parts(hf_config or built_for or _load_hf_config(hf_dir))[0]
    with ExitStack() as stack:
        reader = HFCheckpointReader(hf_dir, stack)
        for mapping in mesh_mappings(models, hf_config, mesh):
            missing = [name for name in mapping.hf_names if name not in reader]
            if missing and mapping.global_name.startswith("output_layer.value."):
                continue  # a fresh critic head, initialised by build_model
            if missing:
                raise KeyError(
                    f"HF checkpoint {hf_dir} lacks {missing} needed for Megatron parameter "
                    f"{mapping.global_name}"
                )
            shard = mapping.shard_from_hf(reader)
            if shard.shape != mapping.param.shape:
                raise ValueError(
                    f"{mapping.global_name}: HF {mapping.hf_names} give shape "
                    f"{tuple(shard.shape)}, Megatron shard is {tuple(mapping.param.shape)}"
                )
            mapping.param.copy_(shard)


def _split(mapping: ParamMapping, mesh: Mesh) -> tuple[int, Any]:
    """(size, group) of the tensor-parallel group splitting this parameter."""
    return (mesh.etp, mesh.etp_group) if mapping.expert else (mesh.tp, mesh.tp_group)


def _tp_gather(mapping: ParamMapping, mesh: Mesh) -> torch.Tensor:
    """The TP-gathered tensor; for a routed expert with EP, one per EP rank: [ep, *full]."""
    local = mapping.param.detach()
    size, group = _split(mapping, mesh)
    full = local.clone()
    if mapping.partition_dim is not None and size > 1:
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        full = torch.cat(shards, dim=mapping.partition_dim)
    if mapping.expert and mesh.ep > 1:
        # gloo takes a flat output only (as reshard's gathers)
        experts = torch.empty(mesh.ep * full.numel(), dtype=full.dtype, device=full.device)
        dist.all_gather_into_tensor(experts, full.contiguous().view(-1), group=mesh.ep_group)
        full = experts.view(mesh.ep, *full.shape)
    return full


def _full_shape(mapping: ParamMapping, mesh: Mesh) -> tuple[int, ...]:
    shape = list(mapping.param.shape)
    if mapping.partition_dim is not None:
        shape[mapping.partition_dim] *= _split(mapping, mesh)[0]
    if mapping.expert and mesh.ep > 1:
        shape.insert(0, mesh.ep)
    return tuple(shape)


def _to_hf(
    hf_config: Any, mesh: Mesh, global_name: str, expert: bool, full: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    if not (expert and mesh.ep > 1):
        yield from megatron_to_hf(hf_config, mesh.tp, global_name, full, etp=mesh.etp)
        return
    local_experts = hf_config.num_experts // mesh.ep
    for ep_rank, expert_full in enumerate(full):  # [ep, *full]: the same weight of each EP rank
        name = renumber_expert(global_name, (ep_rank - mesh.ep_rank) * local_experts)
        yield from megatron_to_hf(hf_config, mesh.tp, name, expert_full, etp=mesh.etp)


@torch.no_grad()
def iter_hf_weights(
    models: Sequence[torch.nn.Module], mesh: Mesh, hf_config: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF tensor on every rank, one at a time (collective; module docstring)."""
    hf_config = _hf_config_of(models, hf_config)
    mappings = [m for m in mesh_mappings(models, hf_config, mesh) if not m.skip_export]
    by_name = {m.global_name: m for m in mappings}
    # What each pipeline stage holds: TP ranks of a stage agree (and a pipeline's stages share
    # their EP rank), so exchanging inside the PP group tells every rank the full list (name,
    # full shape, dtype, expert) in a common order.
    local = [(m.global_name, _full_shape(m, mesh), str(m.param.dtype), m.expert) for m in mappings]
    per_stage = [local]
    if mesh.pp > 1:
        per_stage = [None] * mesh.pp
        dist.all_gather_object(per_stage, local, group=mesh.pp_group)
    for stage, entries in enumerate(per_stage):
        for global_name, shape, dtype_name, expert in entries:
            if stage == mesh.pp_rank:
                full = _tp_gather(by_name[global_name], mesh)
            else:
                dtype = getattr(torch, dtype_name.removeprefix("torch."))
                full = torch.empty(shape, dtype=dtype, device=device())
            if mesh.pp > 1:
                source = dist.get_global_rank(mesh.pp_group, stage)
                dist.broadcast(full, src=source, group=mesh.pp_group)
            yield from _to_hf(hf_config, mesh, global_name, expert, full)


def save_hf_checkpoint(
    models: Sequence[torch.nn.Module],
    mesh: Mesh,
    out_dir: str | Path,
    hf_config: Any,
    tokenizer_dir: str | Path | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Write the model as an HF checkpoint into `out_dir` on rank 0 (collective). `tensors`: the
    full HF tensors to write, every rank iterating them (default: `iter_hf_weights`)."""
    out_dir = Path(out_dir)
    writer = ShardWriter(out_dir) if mesh.rank == 0 else None
    if tensors is None:
        tensors = iter_hf_weights(models, mesh, hf_config)
    for name, tensor in tensors:
        if writer is not None:
            writer.add(name, tensor.cpu())
    if writer is not None:
        writer.close()
        # a vision-language model's chunks carry its language model's config; the folder needs
        # the whole model's
        multimodal = getattr(unwrap_chunk(models[0]), "multimodal_config", None) if models else None
        (multimodal or hf_config).save_pretrained(out_dir)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
    dist.barrier()


def copy_tokenizer_files(source_dir: str | Path, out_dir: str | Path) -> None:
    """Copy whichever of `TOKENIZER_FILES` exist in `source_dir` into `out_dir` (created)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, Path(out_dir) / name)


class ShardWriter:
    """Streams tensors into safetensors files of at most MAX_SHARD_BYTES each."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > MAX_SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        part = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, self.out_dir / part, metadata={"format": "pt"})
        self.files.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.files) == 1:
            (self.out_dir / self.files[0][0]).rename(self.out_dir / "model.safetensors")
            return
        weight_map = {}
        total = len(self.files)
        for index, (part, names) in enumerate(self.files):
            final = f"model-{index + 1:05d}-of-{total:05d}.safetensors"
            (self.out_dir / part).rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = self.out_dir / "model.safetensors.index.json"
        index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
