"""``model.path`` as a Hugging Face Hub id (``Qwen/Qwen2.5-7B-Instruct``): its local snapshot
folder through ``rlcli.data.hub`` (downloaded when online, from the cache when offline)."""

from __future__ import annotations

from rlcli.data.hub import hub_snapshot, looks_like_hub_id

# What a training run needs from a model repository (no *.bin, no other formats' duplicates).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """``path`` itself for a local folder (or anything that is not a Hub id); for a Hub id the
    local snapshot folder."""
    if not looks_like_hub_id(path) or ":" in path:
        return path
    return str(hub_snapshot(path, "model", MODEL_FILES, key))
