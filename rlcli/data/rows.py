"""Reading and writing prompt rows: JSONL and Parquet files, with errors that name the row.

A row is one JSON object (one JSONL line, one Parquet row). Its position is reported the way
a user finds it again: ``line N`` (1-based) in a JSONL file, ``row N`` (0-based, the index
pandas/pyarrow show) in a Parquet file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rlcli.errors import UserError

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


@dataclass(frozen=True)
class RowLocation:
    """Where a row came from, for error messages: ``data/train.jsonl, line 7``."""

    path: str
    is_jsonl: bool
    position: int  # 1-based line for JSONL, 0-based row index for Parquet

    def __str__(self) -> str:
        unit = "line" if self.is_jsonl else "row"
        return f"{self.path}, {unit} {self.position}"


def read_rows(path: str) -> Iterator[tuple[RowLocation, dict[str, Any]]]:
    """Yield ``(location, row)`` for every row of a ``.jsonl`` or ``.parquet`` file.

    Blank JSONL lines are skipped. Raises ``UserError`` for a missing file, an unsupported
    extension, a line that is not valid JSON or a row that is not a JSON object.
    """
    if not os.path.isfile(path):
        raise UserError(f"data file not found: {path}")
    extension = os.path.splitext(path)[1].lower()
    if extension == ".jsonl":
        yield from _read_jsonl(path)
    elif extension == ".parquet":
        yield from _read_parquet(path)
    else:
        raise UserError(
            f"unsupported data file extension {extension or '(none)'!r} for {path}; "
            f"valid choices: {', '.join(SUPPORTED_EXTENSIONS)}"
        )


def _read_jsonl(path: str) -> Iterator[tuple[RowLocation, dict[str, Any]]]:
    # Bytes, decoded line by line, so that a file that is not UTF-8 is reported at its line.
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            location = RowLocation(path, is_jsonl=True, position=line_number)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(
                    f"{location}: not UTF-8 text (byte {raw[error.start]:#04x} at column "
                    f"{error.start + 1}); JSONL files must be UTF-8, e.g. convert with "
                    f"`iconv -f latin1 -t utf-8`"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(
                    f"{location}: invalid JSON ({error.msg} at column {error.colno})"
                ) from error
            if not isinstance(row, dict):
                raise UserError(f"{location}: expected a JSON object, got {type(row).__name__}")
            yield location, row


def _read_parquet(path: str) -> Iterator[tuple[RowLocation, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: cannot read as Parquet ({error})") from error
    row_index = 0
    # Record batches keep memory flat for large files; to_pylist turns structs into dicts.
    for batch in parquet_file.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield RowLocation(path, is_jsonl=False, position=row_index), row
            row_index += 1


def write_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON lines (UTF-8, one object per line); create parent dirs; return count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count
