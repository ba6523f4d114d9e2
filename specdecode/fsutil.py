"""File-system helpers shared by the caches (converted models, features, heads)."""

from __future__ import annotations

import os
from pathlib import Path


def make_readable(path: str | Path) -> None:
    """Give ``path`` (a file, or every file under a directory) the mode a new file gets here: 0666
    less the umask. Some writers (safetensors) create files 0600, which other users of a shared
    cache then cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    root = Path(path)
    for file in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        os.chmod(file, 0o666 & ~umask)
