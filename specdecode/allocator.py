"""Keep freed memory in the process's heap (glibc) instead of handing it back to the system.

A CPU training step allocates and frees the same large tensors every step (log-probabilities over the
draft vocabulary, activations, gradients). glibc serves blocks over its mmap threshold (dynamic, at
most 32 MiB) with fresh ``mmap`` calls and trims the heap top after frees, so every step faults its
pages in again, and the kernel zeroes each one; in a sandboxed kernel a fault costs far more (a
profile of a bf16 EAGLE step showed 90 ms to zero-fill one 33 MB block). On the 2-core machine of
docs/benchmarks.md (session 16) the median of seven such training steps was 2.19 / 1.93 / 1.96 s
without, 1.81 / 1.75 s with these settings as environment variables and 2.13 / 1.60 / 1.94 s with this call
(docs/bench/eagle/avx512bf16-training/train_step_bench.py): 5-10 % on average, within the noise for any single pair. The same effect is
why PyTorch's CPU tuning guides preload jemalloc or tcmalloc; this does it with glibc's own knobs
(``mallopt``), from inside the process, so no launcher or preload is needed. The cost is resident
memory: what a step freed stays mapped (plus ``TOP_PAD`` of slack at the top of the heap).

Training only: tried on inference (docs/benchmarks.md, session 17; docs/bench/allocator/avx512bf16-inference/alloc_inference_bench.py),
a 768-token prefill was 6 % faster but 1-token decode and 5-token verify steps 8-11 % slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap, so frees are reused
TRIM_THRESHOLD = (1 << 31) - 1  # never trim the heap top (mallopt takes an int)
TOP_PAD = 512 << 20  # grow the heap in large steps


SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))


def retain_freed_memory(libc=None) -> bool:
    """Tell glibc's malloc to reuse freed blocks rather than unmap and fault them in again. True
    when applied; False (nothing changed) on another C library or platform. ``libc``: for tests."""
    if libc is None:
        if not sys.platform.startswith("linux"):
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        except (OSError, AttributeError):
            return False
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl has no such knobs
        return False
    mallopt = libc.mallopt
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
