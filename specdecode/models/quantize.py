"""Quantized models: int8 / int4 weights for the drafter's linear layers (the target is untouched), and,
only when a user asks for it with ``--target-quantization``, for the target (a *different* model).

Verification never depends on how the draft computed its distribution: the drafter samples from the
quantized model's own (warped) logits and hands exactly that distribution to the verifier, so the
output still follows the target's law. Quantization only changes the draft's cost (c) and how well
it agrees with the target (acceptance).

Modes (``--draft-quantization``, or a ``@mode`` suffix on the draft spec):

* ``int8`` — int8 weights, one scale per output channel. The kernel is chosen by measurement
  (docs/benchmarks.md; ``docs/bench/quantized-draft/avx512bf16-humaneval8/draft_kernels.py`` for speed, ``docs/bench/quantized-draft/avx512bf16-humaneval8/draft_fidelity.py`` for
  agreement): a float32 draft on the CPU uses dynamic quantization (activations quantized per call,
  fbgemm kernels; ``torch.ao``), because PyTorch's weight-only int8 kernel
  (``aten._weight_int8pack_mm``) with float32 activations was 2-6x *slower* than float32 on both
  AVX512 CPUs measured. bf16/fp16 drafts and CUDA use that weight-only kernel (the gpt-fast recipe): on
  an AVX512-BF16 CPU it took 26 ms per 0.5B forward's linears (bf16: 48 ms) and kept the draft's
  predictions (top-1 agreement with the unquantized draft 0.98), where dynamic int8, though faster
  (17 ms), moved them (0.88: its per-call activation scale crushes the channels beside Qwen's
  activation outliers). A quantized *target* always uses weight-only (dynamic quantization would
  make a row's logits depend on the batch).
* ``int4`` — weight-only int4, groups of 32 along the input, asymmetric, bf16 compute
  (``aten._weight_int4pack_mm_for_cpu``; CPU only).
* ``auto`` — the fastest of none / int8 / int4 for a single-token draft forward on this machine
  (none unless clearly faster), measured once and cached per (model, device, dtype, torch).

Every ``nn.Linear`` of the decoder is replaced, and the LM head (a quarter of a 0.5B model's weights
at a 152k vocabulary); the input embedding stays as it is. The parameters left unquantized (the
embedding, the norms) are then copied out of the weights file's memory map, so that the map, and the
file pages quantizing read through it, are let go: otherwise one small tensor kept the whole file
resident and a quantized draft's peak memory exceeded the unquantized one's (docs/benchmarks.md,
session 12; ``build.load_pair`` also quantizes a torch draft before loading the target).

``--target-quantization`` is **lossy** with respect to the model the user named: the output then
follows the quantized target's law exactly (speculation stays exact), and every output says so
(``"lossy": true``, ``"target_quantization"``); ``check`` verifies against the quantized target.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import warnings
from typing import Any, cast
from pathlib import Path

import torch
from torch import nn

MODES = ("none", "int8", "int4", "auto")
# a .gguf draft kept quantized on llama.cpp's kernels beside any target: its own types ("gguf"), or
# requantized once by llama.cpp's quantizer into the cache (see specdecode.models.llamacpp.requantize)
GGUF_MODES = ("gguf", "q8_0", "q4_0")
DRAFT_MODES = MODES + GGUF_MODES  # --draft-quantization
TARGET_MODES = ("none", "int8", "int4")  # --target-quantization (auto measures a draft's speed, not a target's)
INT4_GROUP = 32


# Rows quantized at a time: the float32 working copy of a 152k-row LM head is 0.5 GiB, which made a
# quantized draft's peak RSS *higher* than the bf16 draft's (docs/benchmarks.md, session 12).
ROW_BLOCK = 2048  # a multiple of 64 (the int4 packing tile)


def _row_blocks(weight: torch.Tensor):
    for start in range(0, weight.shape[0], ROW_BLOCK):
        yield weight[start : start + ROW_BLOCK].detach().float()


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scales = [], []
        for w in _row_blocks(linear.weight):
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [rows]
            q.append(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
            scales.append(scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.cat(q))
        self.register_buffer("scales", torch.cat(scales).to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scales.to(x.dtype))
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4WeightOnlyLinear(nn.Module):
    """Asymmetric int4 weights in groups of ``INT4_GROUP`` input features (computed in bfloat16)."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        n, k = linear.weight.shape
        if k % group:
            raise ValueError(f"int4: {k} input features are not a multiple of the group size {group}")
        packed: list[torch.Tensor] = []
        sz: list[torch.Tensor] = []
        for w in _row_blocks(linear.weight):  # the CPU packing works in 64-row tiles: blocks concatenate
            w = w.reshape(-1, k // group, group)
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            scale = ((hi - lo) / 15).clamp(min=1e-12)
            q = torch.round((w - lo) / scale).clamp_(0, 15).to(torch.int32).reshape(-1, k)
            zero = lo + 8 * scale  # the kernel dequantizes (q - 8) * scale + zero
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            sz.append(torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1))  # [rows, K/g, 2]
        self.in_features, self.out_features, self.group = k, n, group
        self.register_buffer("weight", torch.cat(packed))
        scales_and_zeros = torch.cat(sz)  # [N, K/g, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.group, self.scales_and_zeros
        )
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def _replace_linears(model: Any, make) -> int:  # a transformers model (its output layer by name)
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
                count += 1
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):  # a tied head is reached here only through get_output_embeddings
        model.set_output_embeddings(make(head))
        count += 1
    return count


def quantize_model(model: nn.Module, mode: str, row_independent: bool = False) -> nn.Module:
    """Quantize ``model`` in place (``none``: unchanged). ``auto`` is resolved by :func:`auto_mode` first.

    ``row_independent`` (a quantized *target*): never quantize activations per call. Dynamic int8
    scales a call's activations by their joint range, so a row's logits would depend on the other
    rows of the batch and on the verify width, and the quantized target would not be one function
    that speculation can reproduce; weight-only int8 keeps each row's result its own."""
    if mode not in MODES or mode == "auto":
        raise ValueError(f"unknown quantization {mode!r}: choose none, int8, int4 (drafts also auto)")
    if mode == "none":
        return model
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if mode == "int8":
        dynamic = device.type == "cpu" and dtype == torch.float32 and not row_independent
        _replace_linears(model, DynamicInt8Linear if dynamic else Int8WeightOnlyLinear)
    else:
        if device.type != "cpu":
            raise ValueError("int4 draft quantization runs on the CPU kernel only; use int8 on CUDA")
        _replace_linears(model, Int4WeightOnlyLinear)
    _own_memory(model)
    cast(Any, model).quantization = mode  # a plain attribute: what the draft was quantized to
    return model


def _own_memory(model: nn.Module) -> None:
    """Copy the CPU parameters and buffers of the modules left unquantized into memory of their own
    (they may be views of a memory-mapped weights file), then collect what no longer refers to the map."""
    import gc

    quantized = (Int8WeightOnlyLinear, Int4WeightOnlyLinear, DynamicInt8Linear)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, quantized):
                continue
            for _, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor is not None and tensor.device.type == "cpu":
                    tensor.data = tensor.data.clone()
    gc.collect()


class DynamicInt8Linear(nn.Module):
    """Dynamic int8 (fbgemm): int8 weights, activations quantized per call; computes in float32 (other
    dtypes are cast around it, for measurements: see the module docstring for where it is used)."""

    def __init__(self, linear: nn.Linear, per_channel: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = _dynamic_int8(linear, per_channel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return self.inner(x)
        return self.inner(x.float()).to(x.dtype)


def _dynamic_int8(linear: nn.Linear, per_channel: bool = True) -> nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    if linear.weight.dtype != torch.float32:  # fbgemm quantizes from float32 weights
        f32 = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        f32.load_state_dict({k: v.float() for k, v in linear.state_dict().items()})
        linear = f32
    with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated; the kernels are what we measured
        warnings.simplefilter("ignore", UserWarning)
        return DynamicLinear.from_float(_with_qconfig(linear, per_channel))


def _with_qconfig(linear: nn.Linear, per_channel: bool = True) -> nn.Linear:
    # one weight scale per output channel: torch.ao's default (one per tensor) cost the 0.5B draft much
    # of its agreement with the target (docs/benchmarks.md, session 12; docs/bench/quantized-draft/avx512bf16-humaneval8/draft_fidelity.py)
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    cast(Any, linear).qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    return linear


# -- auto: measured on this machine, cached ------------------------------------------------------------


def _time_forward(model: nn.Module, reps: int = 5) -> float:
    device = next(model.parameters()).device
    ids = torch.tensor([[1]], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        model(ids)  # warm-up
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            model(ids)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def auto_mode(model: nn.Module, name: str, cache_dir: Path | None = None, recalibrate: bool = False) -> str:
    """The fastest of none / int8 / int4 for a single-token forward of ``model`` (named ``name``),
    measured on copies, cached under ``cache_dir/calibration`` per (name, device, dtype, torch version):
    another device or dtype is measured afresh."""
    import copy

    from specdecode.models.fetch import cache_root

    param = next(model.parameters())
    key = f"{name}|{param.device}|{param.dtype}|torch {torch.__version__}"
    path = (
        (cache_dir or cache_root())
        / "calibration"
        / f"draft-quantization-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    )
    if path.is_file() and not recalibrate:
        return json.loads(path.read_text())["mode"]
    device = param.device
    candidates = ["none", "int8"] + (["int4"] if device.type == "cpu" else [])
    times: dict[str, float] = {}
    for mode in candidates:
        trial = model if mode == "none" else quantize_model(copy.deepcopy(model), mode)
        times[mode] = _time_forward(trial)
        del trial
    best = min(times, key=lambda m: times[m])
    if times[best] > 0.9 * times["none"]:  # not clearly faster: keep the draft as it is
        best = "none"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "mode": best, "seconds": times}, indent=2))
    return best
