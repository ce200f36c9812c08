"""HF <-> Megatron weight conversion.

    load_hf_weights(models, mesh, hf_dir)                     HF safetensors -> this rank's shards
    hf_model_dir_problem(hf_dir) -> str | None                why a folder would not load
    iter_hf_weights(models, mesh) -> Iterator[(hf_name, t)]   full HF tensors on every rank
    save_hf_checkpoint(models, mesh, out_dir, hf_config, tokenizer_dir=None)
    param_mappings(models, hf_config, tp, tp_rank)            per-parameter pieces for resharding
    megatron_to_hf(hf_config, tp, global_name, full)          TP-gathered tensor -> HF tensors
    get_family(model_type), supported_model_types()           the per-family registry

Families live one per file (`qwen2.py`, `llama.py`); see `registry.py`. Building chunks and
loading them in one call: `parallel.hf_model.load_hf_model`; Megatron-vs-HF checks:
`parallel.parity`.
"""

from parallel.convert.hf_io import (
    HFCheckpointReader,
    hf_model_dir_problem,
    iter_hf_weights,
    load_hf_weights,
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
    "param_mappings",
    "save_hf_checkpoint",
    "supported_model_types",
]
