"""Batch-invariant mode: each row computed the same way whatever else shares its forward.

Why results depend on the batch at all: a BLAS picks its kernel (blocking, reduction order, gemv
or gemm) from the call's shape, so row ``r`` of ``x @ W.T`` differs in its last bits between a call
of 1 row and one of 5 (measured on a Xeon for float32 and bfloat16 alike). Near a tie the argmax
flips, so greedy output could depend on who else was in the server's batch, and greedy speculation
(a ``k + 1``-row verify) could differ from target-only decoding (1-row steps). This mode removes
every shape dependence from a decoder layer:

* **Matmuls** (every ``nn.Linear``, the LM head, both attention products) run only at row counts
  of one *class*: sizes that a probe on this machine found to give bit-identical rows whatever the
  row's position and neighbours (the kernel is chosen by shape, never by values). A call of ``n``
  rows is cut into chunks of the class's largest size and the rest is zero-padded to the smallest
  size that holds it. Probed lazily per operation shape, dtype, device and thread count; among
  the classes, the one whose calls take least measured time over the model's expected row counts
  (a draft decodes single rows, a target verifies k + 1 per sequence) wins, and the choice is
  cached on disk (``calibration/batch-invariant-plans.json`` in the cache directory), so every later
  process on the machine computes the same bits.
* **Attention** runs over fixed blocks of :data:`BLOCK` keys, so the batch's longest row never
  changes a reduction: scores per block, an exact max, exponentials, sums within a block and then
  block after block in a fixed order (blocks past a row's length add exact zeros), probabilities
  times values per block, accumulated in the same order. Computed in float32.
* Everything else in a decoder layer (norms, rotary, activations, residuals) is per row already.

Two plans per operation: ``step`` for decode/verify forwards (few rows) and ``bulk`` for prompt
prefill (many rows). The runner, not the batch, decides which: a prompt token is always computed by
``bulk`` and a decoded or verified token by ``step``, whoever shares the forward.

Not covered: tree verification (a tree writes a candidate's key at another index than a chain
does, which reorders the attention sum), attention soft-capping, and models whose layers call
matmuls outside ``nn.Linear`` and the attention interface.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import torch
import torch.nn.functional as F

NAME = "specdecode_batch_invariant"  # the attention implementation's name in Hugging Face's registry
BLOCK = 128  # keys per attention block
STEP_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # row counts probed for decode/verify calls
BULK_SIZES = (16, 32, 64, 128, 256)  # row counts probed for prefill calls
# Row counts a model's calls will have, by role (repeats weigh): a draft model decodes one row per
# sequence per call, with a short catch-up now and then; a target verifies k + 1 rows per sequence
# (1 when it decodes alone) over batches of any size; prefill runs long chunks. Fixed per role, never
# taken from an engine's batch size or draft length: a target-only reference and a speculative engine
# (or two engines of different batch sizes) must choose the same plans to compute the same bits.
DRAFT_WORKLOAD = (1,) * 8 + (2, 3, 4, 5)
TARGET_WORKLOAD = (1,) * 4 + tuple(range(2, 33))
BULK_WORKLOAD = tuple(range(16, 2049, 16))

_BULK = contextvars.ContextVar("specdecode_bulk", default=False)


@contextlib.contextmanager
def bulk() -> Iterator[None]:
    """Forwards inside use the ``bulk`` plans (prompt prefill)."""
    token = _BULK.set(True)
    try:
        yield
    finally:
        _BULK.reset(token)


class InvarianceError(RuntimeError):
    """No row count gives position-independent results for an operation on this machine."""


@dataclass(frozen=True)
class RowPlan:
    sizes: tuple[int, ...]  # ascending row counts that all give bit-identical rows

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """``(rows, padded rows)`` of each call for ``n`` rows."""
        big, out = self.sizes[-1], []
        while n > big:
            out.append((big, big))
            n -= big
        if n:
            out.append((n, next(s for s in self.sizes if s >= n)))
        return out

    def cost(self, n: int, seconds: dict[int, float]) -> float:
        return sum(seconds[size] for _, size in self.chunks(n))


def choose(classes: list[tuple[int, ...]], workload: tuple[int, ...], seconds: dict[int, float]) -> RowPlan:
    """The class whose plan takes least time (``seconds`` per call of each row count) over ``workload``."""
    if not classes:
        raise InvarianceError("no row count gives position-independent rows")
    plans = [RowPlan(tuple(sorted(c))) for c in classes]
    return min(plans, key=lambda p: sum(p.cost(n, seconds) for n in workload))


def timings(
    run: Callable[[torch.Tensor], torch.Tensor],
    lead: tuple[int, ...],
    width: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 3,
) -> dict[int, float]:
    """Median seconds of one call of each row count (after a warm-up call)."""
    out = {}
    for m in sizes:
        rows = torch.randn(*lead, m, width, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        run(rows)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(rows)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[m] = statistics.median(times)
    return out


# Outputs compared per row count. Rounding to a low-precision output hides most last-bit differences
# of the accumulator (bf16 on a Xeon: ~1 output in 8,000 differs between a 1-row and a 4-row call),
# so the probe looks at many outputs: enough rows for this many values, within the bounds below.
PROBE_VALUES = 150_000
PROBE_ROWS = (12, 512)


def probe(
    run: Callable[[torch.Tensor], torch.Tensor],
    lead: tuple[int, ...],
    width: int,
    candidates: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[int, ...]]:
    """Classes of ``candidates``: row counts at which ``run`` (rows ``[*lead, m, width]`` -> ``[*lead, m, N]``)
    gives each of many probe rows (:data:`PROBE_VALUES`) the same bits in two arrangements (other positions,
    other neighbours; with a leading batch dimension, also alone in a batch of one), and row counts
    that agree with each other on every probe row."""
    g = torch.Generator().manual_seed(0)
    outputs = run(torch.zeros(*lead, candidates[0], width, device=device, dtype=dtype)).shape[-1]
    n = min(PROBE_ROWS[1], max(PROBE_ROWS[0], -(-PROBE_VALUES // (outputs * max(1, math.prod(lead))))))
    probes = torch.randn(*lead, n, width, generator=g).to(device, dtype)
    results: dict[int, torch.Tensor] = {}
    for m in candidates:
        arrangements = []
        for flip in (False, True):
            out = []
            for lo in range(0, n, m):
                part = probes[..., lo : lo + m, :]
                k = part.shape[-2]
                fill = torch.randn(*lead, m - k, width, generator=g).to(device, dtype)
                rows = torch.cat([fill, part.flip(-2)] if flip else [part, fill], dim=-2).contiguous()
                got = run(rows)
                got = got[..., m - k :, :].flip(-2) if flip else got[..., :k, :]
                if lead and flip:  # the first batch entry computed alone
                    alone = run(rows[:1].contiguous())
                    alone = alone[..., m - k :, :].flip(-2) if flip else alone[..., :k, :]
                    got = torch.cat([alone, got[1:]])
                out.append(got)
            arrangements.append(torch.cat(out, dim=-2))
        if torch.equal(arrangements[0], arrangements[1]):
            results[m] = arrangements[0]
    classes: list[list[int]] = []
    for m, rows_out in results.items():
        for c in classes:
            if torch.equal(results[c[0]], rows_out):
                c.append(m)
                break
        else:
            classes.append([m])
    return [tuple(c) for c in classes]


PLAN_FORMAT = "v1"  # bump when the probe or the choice changes: cached plans from before are then ignored
_PLANS: dict[tuple, RowPlan] = {}
_DISK: dict[str, list[int]] | None = None


def _cache_file():
    from specdecode.models.fetch import cache_root

    return cache_root() / "calibration" / "batch-invariant-plans.json"


def _disk() -> dict[str, list[int]]:
    global _DISK
    if _DISK is None:
        try:
            _DISK = json.loads(_cache_file().read_text())
        except (OSError, ValueError):
            _DISK = {}
    return _DISK


def _remember(key: str, plan: RowPlan) -> None:
    """Keep the plan for later processes on this machine (same choice, same bits); best effort."""
    disk = _disk()
    disk[key] = list(plan.sizes)
    try:
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(disk, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def _key(
    kind: str, shape: tuple, mode: str, dtype: torch.dtype, device: torch.device, workload: tuple[int, ...]
) -> tuple:
    """The in-memory key of a plan (a prefill's plan is for :data:`BULK_WORKLOAD` whatever the role)."""
    return (
        kind,
        shape,
        mode,
        dtype,
        str(device),
        torch.get_num_threads(),
        BULK_WORKLOAD if mode == "bulk" else workload,
    )


@dataclass(frozen=True)
class _Need:
    """One operation shape whose row plan a forward will ask for (see :func:`_plan`)."""

    kind: str
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    workload: tuple[int, ...]
    run: Callable[[torch.Tensor], torch.Tensor]
    lead: tuple[int, ...]
    width: int
    mode: str  # step | bulk

    @property
    def key(self) -> tuple:
        return _key(self.kind, self.shape, self.mode, self.dtype, self.device, self.workload)

    @property
    def disk_key(self) -> str:
        kind, shape, mode, dtype, _, threads, workload = self.key
        return "|".join(
            map(
                str,
                (
                    PLAN_FORMAT,
                    kind,
                    shape,
                    mode,
                    dtype,
                    self.device,
                    threads,
                    hash_workload(workload),
                    torch.__version__,
                    _processor(),
                ),
            )
        )

    def known(self) -> RowPlan | None:
        plan = _PLANS.get(self.key)
        if plan is None and self.disk_key in _disk():
            plan = _PLANS[self.key] = RowPlan(tuple(_disk()[self.disk_key]))
        return plan

    def measure(self) -> RowPlan:
        sizes = BULK_SIZES if self.mode == "bulk" else STEP_SIZES
        classes = probe(self.run, self.lead, self.width, sizes, self.dtype, self.device)
        if not classes:
            raise InvarianceError(
                f"batch-invariant mode: {self.kind} {self.shape} in {self.dtype} on {self.device}: "
                "no row count gives position-independent rows"
            )
        plan = choose(
            classes,
            self.key[-1],
            timings(self.run, self.lead, self.width, tuple(m for c in classes for m in c), self.dtype, self.device),
        )
        _remember(self.disk_key, plan)
        _PLANS[self.key] = plan
        return plan

    def cost(self) -> float:
        """A relative guess of what probing it takes (for the progress bar's ETA)."""
        return float(math.prod(self.shape[0]) if self.kind == "linear" else math.prod(self.shape)) * (
            sum(BULK_SIZES) if self.mode == "bulk" else sum(STEP_SIZES)
        )


def _plan(need: _Need) -> RowPlan:
    """The plan for ``need``: known, read from disk, or probed now."""
    plan = need.known()
    if plan is None:  # a shape :func:`prepare` did not foresee: probed on first use
        print(
            f"batch-invariant mode: probing {need.kind} {need.shape} {str(need.dtype).removeprefix('torch.')} "
            f"rows on this machine ({need.mode}; once: cached in {_cache_file()})",
            file=sys.stderr,
            flush=True,
        )
        plan = need.measure()
    return plan


def _mode() -> str:
    return "bulk" if _BULK.get() else "step"


def _linear_need(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    workload: tuple[int, ...],
    mode: str,
    dtype: torch.dtype | None = None,
) -> _Need:
    def run(rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, weight, bias)

    return _Need(
        "linear",
        (tuple(weight.shape), bias is not None),
        dtype or weight.dtype,
        weight.device,
        workload,
        run,
        (),
        weight.shape[-1],
        mode,
    )


def _bmm_need(
    shape: tuple[int, int],
    device: torch.device,
    workload: tuple[int, ...],
    mode: str,
    dtype: torch.dtype = torch.float32,
) -> _Need:
    """``[G, M, K] @ [G, K, N]`` with ``shape = (K, N)`` (attention computes it in float32), probed against
    random right-hand sides."""

    def probe_run(rows: torch.Tensor) -> torch.Tensor:
        other = torch.randn(rows.shape[0], *shape, generator=torch.Generator().manual_seed(1))
        return torch.bmm(rows, other.to(rows.device, rows.dtype))

    return _Need("bmm", tuple(shape), dtype, device, workload, probe_run, (3,), shape[0], mode)


def needs(model: torch.nn.Module) -> list[_Need]:
    """Every plan an enabled ``model``'s forwards ask for: each linear layer's shape in decode/verify
    steps and in prefill (the output layer only in steps: prefill keeps hidden states, not logits), and
    the attention products per head size."""
    out: dict[tuple, _Need] = {}
    head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    device = next(model.parameters()).device
    for m in model.modules():
        if isinstance(m, InvariantLinear):
            for mode in ("step",) if m is head else ("step", "bulk"):
                need = _linear_need(m.weight, m.bias, m.workload, mode)
                out.setdefault(need.key, need)
        workload = getattr(m, "_specdecode_workload", None)
        config = getattr(m, "config", None)
        if workload is not None and config is not None and getattr(config, "num_attention_heads", None):
            d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            for shape in ((d, BLOCK), (BLOCK, d)):
                for mode in ("step", "bulk"):
                    need = _bmm_need(shape, device, workload, mode)
                    out.setdefault(need.key, need)
    return list(out.values())


def prepare(model: torch.nn.Module, progress: bool = True) -> int:
    """Choose now, under one progress bar with an ETA, every row plan ``model``'s forwards will ask for
    that this machine has not chosen before (instead of one probe at a time at first use, mid-request).
    Returns how many were probed (0 once cached)."""
    from tqdm import tqdm

    todo = [n for n in needs(model) if n.known() is None]
    if not todo:
        return 0
    with tqdm(
        total=sum(n.cost() for n in todo),
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0,
        desc=f"batch-invariant mode: probing {len(todo)} kernel shapes on this machine (once; cached in "
        f"{_cache_file().parent})",
        bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed}<{remaining}",
    ) as bar:
        for need in todo:
            need.measure()
            bar.update(need.cost())
    return len(todo)


def hash_workload(workload: tuple[int, ...]) -> str:
    return hashlib.sha256(repr(workload).encode()).hexdigest()[:12]


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def plans() -> dict[str, tuple[int, ...]]:
    """The plans chosen so far, for reports: ``"linear (N, K) step float32" -> sizes``."""
    return {
        f"{k[0]} {k[1]} {k[2]} {str(k[3]).removeprefix('torch.')} workload {hash_workload(k[6])}": p.sizes
        for k, p in _PLANS.items()
    }


def _by_plan(rows: torch.Tensor, plan: RowPlan, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``run`` over ``rows`` ``[..., n, K]`` (rows on the second-to-last axis) in the plan's chunks,
    each copied into a fresh zero-padded buffer so every call sees the same shape and layout."""
    n, outs, lo = rows.shape[-2], [], 0
    if n == 0:
        return run(rows)
    for count, size in plan.chunks(n):
        buf = rows.new_zeros(*rows.shape[:-2], size, rows.shape[-1])
        buf[..., :count, :] = rows[..., lo : lo + count, :]
        outs.append(run(buf)[..., :count, :])
        lo += count
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, workload: tuple[int, ...] = TARGET_WORKLOAD
) -> torch.Tensor:
    def run(rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, weight, bias)

    rows, mode = x.reshape(-1, x.shape[-1]), _mode()
    plan = _PLANS.get(_key("linear", (tuple(weight.shape), bias is not None), mode, x.dtype, x.device, workload))
    if plan is None:  # (a forward's hot path looks up the key alone)
        plan = _plan(_linear_need(weight, bias, workload, mode, x.dtype))
    return _by_plan(rows, plan, run).reshape(*x.shape[:-1], weight.shape[0])


def bmm(a: torch.Tensor, b: torch.Tensor, workload: tuple[int, ...] = TARGET_WORKLOAD) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N]`` with row counts from the plan (``b`` made contiguous)."""
    b = b.contiguous()

    def run(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(rows, b[: rows.shape[0]])

    mode = _mode()
    plan = _PLANS.get(_key("bmm", tuple(b.shape[1:]), mode, a.dtype, a.device, workload))
    if plan is None:
        plan = _plan(_bmm_need((b.shape[1], b.shape[2]), a.device, workload, mode, a.dtype))
    return _by_plan(a, plan, run)


class InvariantLinear(torch.nn.Linear):
    """``nn.Linear`` computed with :func:`linear` (same parameters, same state dict)."""

    workload = TARGET_WORKLOAD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.workload)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention interface: ``query [B, h, q, d]``, ``key/value [B, kv_heads, L, d]``,
    ``attention_mask [B, 1, q, L]`` (bool: visible, or additive float) -> ``[B, q, h, d]``."""
    if softcap:
        raise ValueError("batch-invariant attention does not support attention soft-capping")
    if dropout:
        raise ValueError("batch-invariant attention is for inference (dropout 0)")
    batch, heads, q, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    workload = getattr(module, "_specdecode_workload", TARGET_WORKLOAD)
    scaling = d**-0.5 if scaling is None else scaling
    blocks = max(1, math.ceil(length / BLOCK))
    pad = blocks * BLOCK - length
    if attention_mask is None:
        visible = torch.ones(batch, 1, q, length, dtype=torch.bool, device=query.device)
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        visible = attention_mask == 0
    rows = groups * q  # the query heads sharing a key head are rows of one product: K/V are read once
    visible = F.pad(visible, (0, pad), value=False)[:, :, None].expand(batch, kv_heads, groups, q, -1)
    visible = visible.reshape(batch * kv_heads, rows, -1)
    qf = query.float().reshape(batch * kv_heads, rows, d)
    keys = F.pad(key.float(), (0, 0, 0, pad)).reshape(batch * kv_heads, length + pad, d)
    values = F.pad(value.float(), (0, 0, 0, pad)).reshape(batch * kv_heads, length + pad, d)
    spans = [slice(j * BLOCK, (j + 1) * BLOCK) for j in range(blocks)]
    scores = torch.cat([bmm(qf, keys[:, s].transpose(1, 2), workload) for s in spans], dim=-1) * scaling
    scores.masked_fill_(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.exp(scores - top)  # masked keys: exactly 0
    denom = torch.zeros(batch * kv_heads, rows, 1, device=query.device)
    out = torch.zeros(batch * kv_heads, rows, d, device=query.device)
    for s in spans:  # block by block, always in this order: blocks past a row's keys add exact zeros
        p = probs[:, :, s]
        denom = denom + p.sum(dim=-1, keepdim=True)
        out = out + bmm(p, values[:, s], workload)
    out = out / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(batch, heads, q, d).transpose(1, 2).contiguous().to(query.dtype), None


_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, attention)
        _REGISTERED = True


def enable(model: torch.nn.Module, workload: tuple[int, ...] = TARGET_WORKLOAD) -> torch.nn.Module:
    """Make ``model`` batch-invariant in place: its ``nn.Linear`` layers become :class:`InvariantLinear`
    and every Hugging Face model inside it runs :func:`attention`; the row plans are chosen for
    ``workload`` (:data:`TARGET_WORKLOAD` or :data:`DRAFT_WORKLOAD`). Idempotent."""
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = InvariantLinear
        if isinstance(m, InvariantLinear):
            m.workload = workload
        if hasattr(m, "layer_idx") or type(m).__name__.endswith("Attention"):
            cast(Any, m)._specdecode_workload = workload  # read by the attention function (a plain attribute)
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            if getattr(config, "attn_logit_softcapping", None):
                raise ValueError(
                    f"{config.model_type}: attention soft-capping is not supported by batch-invariant mode"
                )
            register()
            if config._attn_implementation != NAME:
                config._specdecode_plain_attention = config._attn_implementation
            config._attn_implementation = NAME
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable` (for side-by-side measurements on one set of weights)."""
    for m in model.modules():
        if type(m) is InvariantLinear:
            cast(Any, m).__class__ = torch.nn.Linear
        config = getattr(m, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == NAME:
            config._attn_implementation = getattr(config, "_specdecode_plain_attention", "sdpa")
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == NAME
