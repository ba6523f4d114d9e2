"""What a decode step costs after the kernel drops a model's pages, with --weights mapped and resident.

Loads the model twice through the torch backend's loader (float32 on the CPU), times one-token forwards
warm, then asks the kernel to page out every file-backed page of the safetensors map (madvise
MADV_PAGEOUT: what memory pressure does, on demand) and times the next forwards. Mapped weights are read
back from disk inside the forward; resident ones are not file-backed, so nothing is dropped. Linux only.

    python docs/bench/weights/paged_out.py --model qwen2.5-coder-0.5b --out docs/bench/weights/avx2-0.5b.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdecode.models.loading import load_model

MADV_PAGEOUT = 21


def file_backed_mb() -> int:
    """Resident pages of safetensors maps in this process (MiB), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(".safetensors")
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total // 1024


def page_out() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                libc.madvise(lo, hi - lo, MADV_PAGEOUT)


def forwards(model, n: int) -> list[float]:
    ids = torch.tensor([[100]])
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = time.perf_counter()
            model(ids)
            out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for weights in ("mapped", "resident") * args.repeats:
        model, _ = load_model(args.model, torch.float32, resident=weights == "resident")
        warm = forwards(model, 4)[1:]
        mapped_mb = file_backed_mb()
        page_out()
        after_mb = file_backed_mb()
        cold = forwards(model, 2)
        rows.append(
            {
                "weights": weights,
                "file_backed_mib": mapped_mb,
                "after_pageout_mib": after_mb,
                "warm_step_s": statistics.median(warm),
                "first_step_after_pageout_s": cold[0],
                "second_step_s": cold[1],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del model
    result = {"model": args.model, "machine": platform.processor() or platform.machine(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
