"""HF <-> Megatron weight conversion.

    load_hf_weights(models, mesh, hf_dir)                     HF safetensors -> this rank's shards
    hf_model_dir_problem(hf_dir) -> str | None                why a folder would not load
    iter_hf_weights(models, mesh) -> Iterator[(hf_name, t)]   full HF tensors on every rank
    save_hf_checkpoint(models, mesh, out_dir, hf_config, tokenizer_dir=None)
    param_mappings(models, hf_config, tp, tp_rank, *, etp, etp_rank, ep, ep_rank)
                                                              per-parameter pieces for resharding
    mesh_mappings(models, hf_config, mesh)                    the same for this rank of a mesh
    megatron_to_hf(hf_config, tp, global_name, full, *, etp)  TP-gathered tensor -> HF tensors
    get_family(model_type), supported_model_types()           the per-family registry

Families live one per file (`llama.py`, `qwen2.py`, `qwen3.py`, `qwen2_moe.py`, `qwen3_moe.py`,
`qwen3_5.py`);
see `registry.py`. Building chunks and
loading them in one call: `parallel.hf_model.load_hf_model`; Megatron-vs-HF checks:
`parallel.parity`.
"""

from parallel.convert.hf_io import (
    HFCheckpointReader,
    hf_model_dir_problem,
    iter_hf_weights,
    load_hf_weights,
    mesh_mappings,
    save_hf_checkpoint,
)
from parallel.convert.mapping import ParamMapping, hf_rule, megatron_to_hf, param_mappings
from parallel.convert.registry import ModelFamily, Rule, get_family, supported_model_types

__all__ = [
    "HFCheckpointReader",
    "ModelFamily",
    "ParamMapping",
    "Rule",
    "get_family",
    "hf_model_dir_problem",
    "hf_rule",
    "iter_hf_weights",
    "load_hf_weights",
    "megatron_to_hf",
    "mesh_mappings",
    "param_mappings",
    "save_hf_checkpoint",
    "supported_model_types",
]
