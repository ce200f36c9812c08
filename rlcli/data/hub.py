"""Hugging Face Hub ids for what a run reads: ``model.path=Qwen/Qwen2.5-7B-Instruct`` and
``data.train_files=[org/name:train]``, as every peer takes them. ``huggingface_hub`` brings the
repository's files into its local cache (downloaded when the Hub can be reached, from the cache
alone when it cannot: ``HF_HUB_OFFLINE=1`` or no network) and rlcli reads the local copies. A
local path always wins over an id of the same spelling."""

from __future__ import annotations

import re
from pathlib import Path

from rlcli.data.rows import SUPPORTED_EXTENSIONS
from rlcli.errors import UserError

# "org/name" (one slash, the Hub's characters; not ./x or ../x), and for datasets ":split".
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<split>[\w.-]+))?$")


def looks_like_hub_id(path: str) -> bool:
    match = _HUB_ID.match(path)
    return match is not None and not Path(path).exists() and not match["repo"].startswith(".")


def hub_snapshot(repo_id: str, repo_type: str, allow_patterns: list[str], key: str) -> Path:
    """The local folder of ``repo_id``'s files (those ``allow_patterns`` match), fetched first
    when the Hub can be reached; a UserError naming ``key`` when neither the Hub nor the cache
    has them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import is_offline_mode
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fetch(local_only: bool) -> Path:
        return Path(
            snapshot_download(
                repo_id,
                repo_type=repo_type,
                allow_patterns=allow_patterns,
                local_files_only=local_only,
            )
        )

    if not is_offline_mode():
        try:
            return fetch(local_only=False)
        except LocalEntryNotFoundError:
            pass  # the Hub could not be reached: the cache alone may still hold it
        except Exception as error:  # noqa: BLE001 - a missing or gated repository
            if "404" in str(error) or "Not Found" in str(error):
                raise UserError(
                    f"{key}={repo_id}: no such {repo_type} on the Hugging Face Hub"
                ) from None
    try:
        return fetch(local_only=True)
    except LocalEntryNotFoundError:
        flag = " --repo-type dataset" if repo_type == "dataset" else ""
        raise UserError(
            f"{key}={repo_id} is not a local path, and the Hugging Face Hub cannot be reached "
            "while the local cache does not hold it: download it where there is a network "
            f"(`huggingface-cli download{flag} {repo_id}`, into the same HF_HOME), or give a "
            "local path"
        ) from None


def _split_of(path: Path) -> str:
    words = re.split(r"[^a-z0-9]+", path.name.lower())
    for split in ("train", "test", "validation", "val"):
        if split in words:
            return split
    return path.stem


def dataset_files(entry: str, key: str) -> list[str]:
    """The local ``.parquet`` / ``.jsonl`` files of a data entry: the entry itself for a local
    path; for ``org/name[:split]`` the dataset's files of that split (its only split when it
    has one), in name order."""
    if not looks_like_hub_id(entry):
        return [entry]
    match = _HUB_ID.match(entry)
    assert match is not None
    patterns = [f"*{ext}" for ext in SUPPORTED_EXTENSIONS] + [
        f"**/*{ext}" for ext in SUPPORTED_EXTENSIONS
    ]
    folder = hub_snapshot(match["repo"], "dataset", patterns, key)
    files = sorted(p for p in folder.rglob("*") if p.suffix in SUPPORTED_EXTENSIONS)
    splits = sorted({_split_of(p) for p in files})
    split = match["split"]
    if split is None and len(splits) > 1:
        raise UserError(
            f"{key}: {entry} has the splits {', '.join(splits)}: name one, e.g. "
            f"{match['repo']}:{splits[0]}"
        )
    chosen = [str(p) for p in files if split is None or _split_of(p) == split]
    if not chosen:
        raise UserError(
            f"{key}: {entry} has no {split!r} split in .parquet / .jsonl files "
            f"(splits: {', '.join(splits) or 'none'})"
        )
    return chosen
