"""File-system helpers shared by the caches (converted models, features, heads) and the JSONL readers (prompt sets,
training corpora)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdecode.errors import UserError


def make_readable(path: str | Path) -> None:
    """Give ``path`` (a file, or every file under a directory) the mode a new file gets here: 0666
    less the umask. Some writers (safetensors) create files 0600, which other users of a shared
    cache then cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    root = Path(path)
    for file in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        os.chmod(file, 0o666 & ~umask)


def read_jsonl(file: Path, error: type[Exception] = UserError) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank line of a JSONL file; a line that is not a JSON object raises
    ``error`` naming the file and line."""
    rows = []
    with file.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{file}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise error(f"{file}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((lineno, row))
    return rows
