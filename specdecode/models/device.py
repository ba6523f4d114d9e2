"""Where models run and in which dtype: the one table of dtype names and the ``auto`` rules.

``--device auto`` is CUDA when present, else the CPU. ``--dtype auto`` is decided from the device
actually used: bfloat16 on CUDA and on CPUs whose bf16 matrix products are native (AVX512-BF16 or
AMX-BF16), float32 elsewhere. On an AVX2-only CPU a bf16 matmul is compute-bound, so verifying
k + 1 tokens costs about k + 1 single-token steps and speculation cannot pay (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: argument parsing stays fast
    import torch

# accepted names -> canonical name (the attribute of ``torch``)
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
}
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")  # what help texts list


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return set()


def native_bf16(device: "torch.device | str" = "cpu") -> bool:
    """True where bf16 matrix products run natively on ``device``."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return True
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: "str | torch.device | None" = "auto") -> "torch.device":
    """``auto`` (or None) -> ``cuda`` when available, else ``cpu``; ``cpu``, ``cuda``, ``cuda:N`` as given."""
    import torch

    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {name!r}: choose auto, cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}: choose auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def dtype_name(name: str, device: "torch.device | str" = "cpu") -> str:
    """A canonical dtype name; ``auto`` is decided for ``device`` (see the module docstring)."""
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def resolve_dtype(name: str, device: "torch.device | str" = "cpu") -> "torch.dtype":
    import torch

    return getattr(torch, dtype_name(name, device))


def dtype_arg(name: str) -> str:
    """argparse ``type=``: validates the name, keeps ``auto`` (decided once the device is known)."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}: choose {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def device_arg(name: str) -> str:
    """argparse ``type=``: validates the spelling (availability is checked when models load)."""
    if name == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", name):
        return name
    raise argparse.ArgumentTypeError(f"unknown device {name!r}: choose auto, cpu, cuda or cuda:N")


def synchronize(runner) -> None:
    """Wait for a runner's queued CUDA work (nothing to wait for elsewhere), so that what is timed ran."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)
