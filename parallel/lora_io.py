"""LoRA adapters (parallel.lora) in HF PEFT's format: export, import, and the engine's folder.

    peft_lora_config(spec, hf_config, base_model_name_or_path="") -> peft.LoraConfig
    expected_peft_shapes(hf_config, spec) -> {peft_name: (rows, cols)}   the full tensors
    write_peft_adapter(out_dir, tensors, config) -> Path       one process writes the folder
    save_peft_adapter(models, mesh, out_dir, base_model_name_or_path) -> Path   collective
    load_peft_adapter(models, mesh, adapter_dir)               every rank reads its own shards
    sync_lora_adapter(models, mesh, engine, folder) -> SyncStats   the `adapter` weight sync
    save_merged_hf_checkpoint(models, mesh, out_dir, hf_config, tokenizer_dir)   collective
    default_adapter_folder() -> Path                           this rank's folder in /dev/shm

A PEFT adapter folder is `adapter_config.json` (written by PEFT's own LoraConfig) and
`adapter_model.safetensors` with, per adapted HF module, `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] (full tensors, gathered over TP and PP). It loads with
`peft.PeftModel.from_pretrained(hf_model, folder)` and with vLLM's `LoRARequest`.

vLLM 0.32 loads LoRA adapters only from a folder (`LoRAModel.from_local_checkpoint` in
`vllm/lora/worker_manager.py`; `from_lora_tensors` is internal, and verl patches `_load_adapter`
to pass tensors), so the `adapter` sync writes the folder to fast local memory (/dev/shm) on
every rank and has the engine load it under a new adapter id (`load_lora_adapter`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.convert.mapping import unwrap_chunk
from parallel.lora import (
    LoraConfigError,
    LoraSpec,
    adapter_params,
    lora_modules,
    lora_spec_of,
    peft_tensor_name,
)
from parallel.mesh import Mesh
from parallel.reshard import SyncStats, iter_adapter_buckets, iter_inference_buckets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_KEY = "actor.lora.adapter_path"  # the config key naming a starting adapter


class AdapterConsumer(Protocol):
    def load_lora_adapter(self, folder: str) -> None: ...


def peft_target_modules(hf_config: Any, spec: LoraSpec) -> list[str]:
    """PEFT's target_modules for the spec: the HF module names (q_proj, ..., down_proj)."""
    names = {m.hf_module.rpartition(".")[2] for m in lora_modules(hf_config, spec)}
    return sorted(names)


def peft_lora_config(spec: LoraSpec, hf_config: Any, base_model_name_or_path: str = ""):
    """The PEFT LoraConfig of these adapters (PEFT's default init: what parallel.lora draws)."""
    from peft import LoraConfig

    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return LoraConfig(
        r=spec.rank,
        lora_alpha=alpha,
        lora_dropout=spec.dropout,
        target_modules=peft_target_modules(hf_config, spec),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path or None,
    )


def expected_peft_shapes(hf_config: Any, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every tensor of the spec's PEFT adapter file and its full shape."""
    shapes = {}
    for m in lora_modules(hf_config, spec):
        shapes[peft_tensor_name(m.hf_module, "A")] = (spec.rank, m.in_features)
        shapes[peft_tensor_name(m.hf_module, "B")] = (m.out_features, spec.rank)
    return shapes


def write_peft_adapter(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], config):
    """Write `tensors` (PEFT names -> full CPU tensors) and `config` (a peft LoraConfig) as a
    PEFT adapter folder; returns it. Not collective."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out_dir


def _gathered(models: Sequence[torch.nn.Module], mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every full adapter tensor on every rank, on the CPU (collective)."""
    return {
        name: tensor.detach().to("cpu", copy=True)
        for bucket in iter_adapter_buckets(models, mesh)
        for name, tensor in bucket
    }


def save_peft_adapter(
    models: Sequence[torch.nn.Module],
    mesh: Mesh,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str = "",
) -> Path:
    """Write the adapters as a PEFT folder into `out_dir` on rank 0 (collective).
    `base_model_name_or_path`: the HF model folder the run trained from (adapter_config.json)."""
    spec, hf_config = _spec_and_config(models)
    tensors = _gathered(models, mesh)
    out_dir = Path(out_dir)
    if mesh.rank == 0:
        config = peft_lora_config(spec, hf_config, str(base_model_name_or_path))
        write_peft_adapter(out_dir, tensors, config)
    dist.barrier()
    return out_dir


def _spec_and_config(models: Sequence[torch.nn.Module]) -> tuple[LoraSpec, Any]:
    spec = lora_spec_of(models)
    if spec is None:
        raise ValueError("the model has no LoRA adapters (parallel.lora.apply_lora)")
    return spec, unwrap_chunk(models[0]).hf_config


def _check_adapter_config(adapter_dir: Path, spec: LoraSpec, hf_config: Any) -> None:
    from peft import LoraConfig

    where = f"{ADAPTER_KEY}={str(adapter_dir)!r}"
    if (
        not (adapter_dir / ADAPTER_CONFIG).is_file()
        or not (adapter_dir / ADAPTER_WEIGHTS).is_file()
    ):
        raise LoraConfigError(
            f"{where}: not a PEFT adapter folder (it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    try:
        config = LoraConfig.from_pretrained(str(adapter_dir))
    except Exception as error:  # noqa: BLE001 - PEFT raises TypeError / ValueError / JSON errors
        raise LoraConfigError(f"{where}: {ADAPTER_CONFIG} is not a LoRA config: {error}") from None
    wanted = {
        "r": (spec.rank, "actor.lora.rank"),
        "lora_alpha": (spec.alpha, "actor.lora.alpha"),
    }
    for field, (value, key) in wanted.items():
        if float(getattr(config, field)) != float(value):
            raise LoraConfigError(
                f"{where}: {ADAPTER_CONFIG} has {field}={getattr(config, field)} but "
                f"{key}={value}; set {key}={getattr(config, field)} to continue this adapter"
            )
    unsupported = {
        "use_rslora": config.use_rslora,
        "use_dora": config.use_dora,
        "rank_pattern": config.rank_pattern,
        "alpha_pattern": config.alpha_pattern,
        "modules_to_save": config.modules_to_save,
        "lora_bias": getattr(config, "lora_bias", False),
    }
    used = [f"{name}={value}" for name, value in unsupported.items() if value]
    if config.bias != "none":
        used.append(f"bias={config.bias!r}")
    if used:
        raise LoraConfigError(
            f"{where}: {ADAPTER_CONFIG} uses {', '.join(used)}, which rlcli's adapters do not "
            "have (plain LoRA only)"
        )


def _check_tensor_names(adapter_dir: Path, names: set[str], expected: dict) -> None:
    where = f"{ADAPTER_KEY}={str(adapter_dir)!r}: {ADAPTER_WEIGHTS}"
    missing, extra = sorted(expected.keys() - names), sorted(names - expected.keys())
    if missing:
        raise LoraConfigError(
            f"{where} lacks {len(missing)} adapter tensors the model has, e.g. {missing[0]}: "
            "set actor.lora.target_modules to the modules the adapter was trained on "
            "(linear_qkv holds q_proj, k_proj and v_proj; linear_fc1 gate_proj and up_proj)"
        )
    if extra:
        raise LoraConfigError(
            f"{where} holds {len(extra)} tensors the model's adapters do not, e.g. {extra[0]}: "
            "check actor.lora.target_modules and that the adapter is for this model"
        )


@torch.no_grad()
def load_peft_adapter(
    models: Sequence[torch.nn.Module], mesh: Mesh, adapter_dir: str | os.PathLike
) -> None:
    """Fill this rank's adapter shards from a PEFT adapter folder (its r, lora_alpha and tensors
    must be those of the model's spec; LoraConfigError naming the file and tensor otherwise).

    Every rank checks the whole file the same way, so all fail alike. Call before building the
    optimizer (or reload its master weights afterwards: parallel.optim.reload_master_weights).
    """
    spec, hf_config = _spec_and_config(models)
    adapter_dir = Path(adapter_dir)
    _check_adapter_config(adapter_dir, spec, hf_config)
    expected = expected_peft_shapes(hf_config, spec)
    with safe_open(adapter_dir / ADAPTER_WEIGHTS, framework="pt") as handle:
        _check_tensor_names(adapter_dir, set(handle.keys()), expected)
        for name, shape in expected.items():
            found = tuple(handle.get_slice(name).get_shape())
            if found != shape:
                raise LoraConfigError(
                    f"{ADAPTER_KEY}={str(adapter_dir)!r}: {ADAPTER_WEIGHTS} tensor {name} has "
                    f"shape {list(found)}, the model's adapter is {list(shape)} (r = "
                    f"actor.lora.rank = {spec.rank}); is the adapter for this model?"
                )
        for entry in adapter_params(models):
            tensor = handle.get_slice(peft_tensor_name(entry.hf_module, entry.matrix))
            local = entry.param.shape
            if entry.partition_dim == 0:
                start = mesh.tp_rank * local[0]
                shard = tensor[start : start + local[0]]
            elif entry.partition_dim == 1:
                start = mesh.tp_rank * local[1]
                shard = tensor[:, start : start + local[1]]
            else:
                shard = tensor[:]
            entry.param.copy_(shard)


def default_adapter_folder() -> Path:
    """This process's adapter folder for `sync_lora_adapter`: in /dev/shm (memory) when there is
    one, else the temp directory."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"rlcli-lora-{os.getuid()}-{os.getpid()}"


def sync_lora_adapter(
    models: Sequence[torch.nn.Module],
    mesh: Mesh,
    engine: AdapterConsumer,
    folder: str | os.PathLike | None = None,
) -> SyncStats:
    """The `adapter` weight sync (collective): gather the adapters, write them on every rank as
    a PEFT folder (overwritten each call; default `default_adapter_folder()`) and have the
    engine load it (`engine.load_lora_adapter(folder)`, which must read it before returning).
    Only adapter bytes move; the engine keeps its base weights."""
    start = time.perf_counter()
    spec, hf_config = _spec_and_config(models)
    tensors = _gathered(models, mesh)
    folder = Path(folder) if folder is not None else default_adapter_folder()
    write_peft_adapter(folder, tensors, peft_lora_config(spec, hf_config))
    engine.load_lora_adapter(str(folder))
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    seconds = time.perf_counter() - start
    return SyncStats(num_bytes, seconds, num_bytes / max(seconds, 1e-9) / 1e9, 1)


def save_merged_hf_checkpoint(
    models: Sequence[torch.nn.Module],
    mesh: Mesh,
    out_dir: str | os.PathLike,
    hf_config: Any,
    tokenizer_dir: str | os.PathLike | None = None,
) -> None:
    """The model with its adapters merged, W + (alpha/r) B A per adapted tensor, as a plain HF
    checkpoint in `out_dir` (rank 0 writes; collective). The tensors are those the `merged`
    weight sync sends (`iter_inference_buckets`); the model itself stays unmerged."""
    from parallel.convert import save_hf_checkpoint

    merged = (pair for bucket in iter_inference_buckets(models, mesh) for pair in bucket)
    save_hf_checkpoint(models, mesh, out_dir, hf_config, tokenizer_dir, tensors=merged)
