"""Patch llama-cpp-python's vendored llama.cpp before it is built (scripts/install-llamacpp.sh).

On a CPU with AMX (Intel Sapphire/Emerald/Granite Rapids), ggml builds AMX kernels for Q4_K/Q6_K/Q4_0/
Q8_0 weights and uses them for every matmul of two or more rows (prefill, verify). Two faults in how it
configures the tiles, each a SIGILL ("Illegal instruction") at the first tile instruction; both seen here
on an Emerald Rapids VM with llama-cpp-python 0.3.36 (upstream: ggml-org/llama.cpp pull request #26954,
open, for the first):

1. The tile configuration is a stack struct handed to ``_tile_loadconfig``; GCC 12 (Debian 12's
   compiler) does not see that the intrinsic reads it, drops the stores of its rows and columns and
   loads an empty configuration. Patch: a compiler barrier that reads the struct before the load.
2. Each thread loads the configuration once (a thread-local flag). torch's oneDNN runs its bf16 matmuls
   with AMX on the same OpenMP threads and releases the tiles after each (``tilerelease``), which
   empties the configuration; llama.cpp's next matmul on that thread then faults. Patch: load the
   configuration on every call (one ``ldtilecfg`` per thread per matmul, well under a microsecond).

Neither changes the arithmetic, and the file is compiled only where the CPU has AMX.

    python scripts/patch_llamacpp.py SOURCE_DIR   # the unpacked llama_cpp_python-X.Y.Z directory

Idempotent: a tree already patched is left as it is. A tree whose code no longer matches exits 1 with
the reason (the pin moved: check whether upstream fixed it, then drop or adapt this patch).
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "/* specdecode: keep the tile configuration's stores (scripts/patch_llamacpp.py) */"
# (old, new) pairs, each to be found exactly once
EDITS = [
    (
        "    _tile_loadconfig(&tc);\n    done = true;",
        f'    {MARK}\n    __asm__ __volatile__("" : : "r"(&tc) : "memory");\n    _tile_loadconfig(&tc);\n    done = true;',
    ),
    (
        "    if (done) {\n        return;\n    }\n",
        "    /* specdecode: load it on every call: torch's oneDNN may have released the tiles on this thread */\n"
        "    (void) done;\n",
    ),
]


def patch(root: Path) -> str:
    mmq = root / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
    if not mmq.is_file():
        raise SystemExit(f"patch_llamacpp: {mmq} not found (is {root} an unpacked llama-cpp-python sdist?)")
    text = mmq.read_text()
    if MARK in text:
        return "already patched"
    for old, new in EDITS:
        if text.count(old) != 1:
            raise SystemExit(
                f"patch_llamacpp: {mmq} no longer holds the AMX tile-config code this patch expects "
                f"({old.strip().splitlines()[0]!r}); see this script's docstring"
            )
        text = text.replace(old, new)
    mmq.write_text(text)
    return "patched"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(f"patch_llamacpp: {patch(Path(sys.argv[1]))} {sys.argv[1]}")
