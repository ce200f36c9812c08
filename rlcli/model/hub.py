"""``model.path`` as a Hugging Face Hub id (``Qwen/Qwen2.5-7B-Instruct``), as every peer takes it:
resolved through ``huggingface_hub`` to the snapshot folder in the local cache, downloaded when
the Hub can be reached, from the cache alone when it cannot (``HF_HUB_OFFLINE=1``, or no
network). A local folder always wins over an id of the same spelling."""

from __future__ import annotations

import re
from pathlib import Path

from rlcli.errors import UserError

# "org/name": one slash, the Hub's allowed characters, not a relative path such as ./x or ../x.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a training run needs from a model repository (no *.bin, no other formats' duplicates).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """``path`` itself for a local folder (or anything that is not a Hub id); for a Hub id the
    local snapshot folder, fetched first when the Hub can be reached."""
    if not looks_like_hub_id(path):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import is_offline_mode
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            path, allow_patterns=MODEL_FILES, local_files_only=is_offline_mode()
        )
    except LocalEntryNotFoundError:
        pass  # offline, or the Hub could not be reached: the cache alone may still hold it
    except Exception as error:  # noqa: BLE001 - a missing or gated repo, a network error
        if "404" in str(error) or "Repository Not Found" in str(error):
            raise UserError(f"{key}={path}: no such model on the Hugging Face Hub") from None
    try:
        return snapshot_download(path, allow_patterns=MODEL_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        raise UserError(
            f"{key}={path} is not a local folder, and the Hugging Face Hub cannot be reached "
            "while the local cache does not hold it: download it where there is a network "
            f"(`huggingface-cli download {path}`, into the same HF_HOME), or give a local folder"
        ) from None
