"""The JSONL files headway writes (regenerated shards, prompt lists), read back with errors
that name the file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from headway.errors import DataError

__all__ = ["DAMAGED", "read_jsonl"]

DAMAGED = "the folder is damaged: remove this file to regenerate it, or use a new --out folder"
"""What to do about a damaged file of a folder headway wrote."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a ``.jsonl`` or ``.jsonl.gz`` file that headway wrote.

    Raises:
        DataError: naming the file (and line) when it is not gzip, UTF-8, or one JSON object
            per line.
    """
    data = path.read_bytes()
    try:
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as error:  # BadGzipFile is an OSError
        raise DataError(f"{path}: cannot be read ({error}); {DAMAGED}") from None
    rows = []
    # Split on "\n" only: str.splitlines() also splits at U+2028 and other separators that
    # json.dumps(ensure_ascii=False) leaves unescaped inside strings.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as error:
            raise DataError(f"{path}:{number}: not JSON ({error}); {DAMAGED}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: not a JSON object; {DAMAGED}")
        rows.append(row)
    return rows
