"""What a step costs on the running machine: the target's verify forward ``v(batch, width)``, each
drafter's proposal ``draft(drafter, rows, k)``, in seconds, and, for a drafter that reads the
sequence's tokens itself (a draft model), the seconds per token of catching up on a history it has
not read (``catch_up(drafter, tokens)``: its prompt prefill, when it starts late).

Measured once at engine start by :func:`calibrate` through the runner and drafter protocols (a
synthetic prompt in scratch slots, the best of three repeats per grid point, then made
non-decreasing in the number of tokens — noise from a shared machine only ever adds time, and a
step never gets cheaper with more tokens), cached as JSON per
(models, device, dtype, backend, threads, grid) under ``<cache>/calibration`` (``--recalibrate``
measures again; a file of another :data:`FORMAT` is measured again, never misread).

Where the selector chooses a draft length — the smallest batches, widths up to :data:`FINE_WIDTHS` —
every width is measured (:func:`widths_at`): a verify's cost is a staircase in its width there, not a
line (llama.cpp's repacked kernels take a matrix's columns in groups, so a width that fills a group
costs about what the one below it does and the next one a whole group more; AMX tiles are wider
still), and a linear model between coarse grid points would hide exactly the cheap widths. Above those
widths and batches the grid is coarse and interpolated linearly (extrapolated past the last point);
at a measured point it is that point. The fine rows add the widths missing from the coarse grid at
each batch up to :data:`FINE_BATCHES`: at these widths a forward costs about one decode step, so the
calibration takes about that many more steps times its repeats.

Running conditions drift from the calibration (longer contexts, another process on the CPU), so
the model also hears every step's measured times (:meth:`CostModel.record`) and keeps, per part
(``verify`` and each drafter) and per width or draft length it has seen, a correction factor:
observed / predicted in log space, the mean of the observations and the calibration's prior, then a
moving average that follows drift (:meth:`CostModel._correct`). A part not yet seen in this run
takes the target's correction (what slowed the target since the calibration slowed the machine),
so a calibration taken on a busy machine is a prior that the first plain steps already correct.
The selector (:mod:`specdecode.selector`) compares plans by ratios of these costs; the correction
keeps those ratios honest as the machine changes.

A calibration is only as good as the machine was quiet while it ran: :func:`calibrate` records how
much CPU other processes used meanwhile and how far its repeats spread (:class:`Noise`). A busy one
is used for the run that measured it but never cached (the next start measures again), and while it
is the prior the selector explores each drafter once whatever that prior says it costs. A cached
calibration that the run's own steps contradict (:data:`DISAGREE`) is dropped from the cache, so the
next start measures again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

Grid = dict[int, dict[int, float]]  # outer (batch or rows) -> inner (width or k) -> seconds

CORRECTION_WEIGHT = 0.1  # weight of each new observation in the correction's moving average, at the least
PRIOR_OBSERVATIONS = 2  # a quiet calibration counts as this many observations (a busy one as none)
CORRECTION_RANGE = (0.05, 20.0)  # a correction never moves a prediction by more than this factor
QUIET_OTHERS = 0.15  # a calibration is trusted when other processes used at most this share of the CPUs ...
QUIET_SPREAD = 1.15  # ... and the median repeat of a grid point took at most this times the fastest
DISAGREE = (1 / 1.5, 1.5)  # a cached calibration the run's steps put outside this factor is measured again
DISAGREE_AFTER = 16  # ... once a part has this many observations


def _interp1(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points``; flat below the first, the last slope past the last."""
    if x in points:  # measured: that point, not a curve through its neighbours
        return points[int(x)]
    xs = sorted(points)
    if len(xs) == 1 or x <= xs[0]:
        return points[xs[0]]
    lo, hi = next(((a, b) for a, b in zip(xs, xs[1:]) if x <= b), (xs[-2], xs[-1]))  # (past the last: its slope)
    t = (x - lo) / (hi - lo)
    return max(0.0, points[lo] + t * (points[hi] - points[lo]))


def _interp2(grid: Grid, outer: float, inner: float) -> float:
    return _interp1({o: _interp1(row, inner) for o, row in grid.items()}, outer)


@dataclass(frozen=True)
class Noise:
    """How quiet the machine was while a calibration ran."""

    others_cpu: float = 0.0  # share of all CPUs that other processes used meanwhile
    spread: float = 1.0  # median over grid points of (median repeat / fastest repeat)

    @property
    def quiet(self) -> bool:
        return self.others_cpu <= QUIET_OTHERS and self.spread <= QUIET_SPREAD

    def describe(self) -> str:
        return f"other processes used {self.others_cpu:.0%} of the CPUs; repeats spread {self.spread:.2f}x"


@dataclass
class CostModel:
    verify: Grid  # batch -> width (queries per row) -> seconds of the target's verify step
    draft: dict[str, Grid]  # drafter name -> rows -> k -> seconds of one proposal of k tokens
    catch_up: dict[str, float] = field(default_factory=dict)  # drafter name -> seconds per token read late
    key: str = ""  # what was measured (models, device, dtype, ...): the cache is keyed by it
    calibration_s: float = 0.0  # how long measuring took
    noise: Noise = field(default_factory=Noise)  # how quiet the machine was meanwhile
    correction: dict[str, float] = field(default_factory=dict)  # part -> log(observed / predicted), EMA
    cells: dict[str, dict[int, float]] = field(default_factory=dict)  # part -> width or k -> the same, per cell
    seen: dict[str, int] = field(default_factory=dict)  # part -> observations in this run
    cell_seen: dict[str, dict[int, int]] = field(default_factory=dict)  # part -> width or k -> the same
    # called once when the run's steps contradict a cached calibration (part, observed / predicted)
    on_disagree: Callable[[str, float], None] | None = field(default=None, repr=False)
    disagreed: str | None = None

    @property
    def trusted(self) -> bool:
        """Measured on a quiet machine (else a prior that the run corrects, never cached)."""
        return self.noise.quiet

    def measured(self, part: str) -> bool:
        """Has this run timed ``part`` (``verify``, a drafter's name, ``<name>/catch-up``)?"""
        return self.seen.get(part, 0) > 0

    def verify_s(self, batch: int, width: int) -> float:
        return self._seconds("verify", self.verify, batch, width)

    def draft_s(self, name: str, rows: int, k: int) -> float:
        if rows <= 0 or k <= 0:
            return 0.0
        return self._seconds(name, self.draft[name], rows, k)

    def _seconds(self, part: str, grid: Grid, outer: int, inner: int) -> float:
        """The corrected prediction; after a busy calibration, whose shape is no evidence either, a width
        or length not yet timed is taken to cost no more than the widest one timed below it (optimism
        that gets it tried once, and then timed: the calibration's distortions cannot keep it unused)."""
        seconds = _interp2(grid, outer, inner) * self._factor(part, inner)
        if not self.trusted and inner not in self.cells.get(part, {}):
            below = [i for i in self.cells.get(part, {}) if i < inner]
            if below:
                i = max(below)
                seconds = min(seconds, _interp2(grid, outer, i) * self._factor(part, i))
        return seconds

    def catch_up_s(self, name: str, tokens: int) -> float:
        """Seconds for drafter ``name`` to read ``tokens`` tokens it has not seen (0 for a drafter
        with no such cost)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.catch_up.get(name, 0.0) * self._factor(f"{name}/catch-up")

    def _factor(self, part: str, inner: int | None = None) -> float:
        """observed / predicted for ``part`` at width or draft length ``inner``: that cell's correction
        once seen, else the part's; a part this run has not timed takes its drafter's (a catch-up) or
        else the target's: the machine's drift since the calibration."""
        if not self.measured(part):
            if part.endswith("/catch-up"):  # (a drafter's name may hold a "/": a path)
                return self._factor(part.removesuffix("/catch-up"))
            return self._factor("verify") if part != "verify" and self.measured("verify") else 1.0
        cell = self.cells.get(part, {}).get(inner) if inner is not None else None
        return math.exp(cell if cell is not None else self.correction.get(part, 0.0))

    def record(self, part: str, outer: int, inner: int, seconds: float) -> None:
        """A measured step: ``part`` is ``verify`` (outer = batch, inner = width) or a drafter's name
        (outer = rows, inner = k)."""
        grid = self.verify if part == "verify" else self.draft.get(part)
        if grid is None or seconds <= 0 or outer <= 0 or inner <= 0:
            return
        predicted = _interp2(grid, outer, inner)
        if predicted <= 0:
            return
        self._correct(part, seconds / predicted, inner)

    def record_catch_up(self, name: str, tokens: int, seconds: float) -> None:
        """A measured catch-up (a late prompt prefill) of ``tokens`` tokens by drafter ``name``."""
        per_token = self.catch_up.get(name, 0.0)
        if tokens <= 0 or seconds <= 0 or per_token <= 0:
            return
        self._correct(f"{name}/catch-up", seconds / (tokens * per_token))

    def _correct(self, part: str, ratio: float, inner: int | None = None) -> None:
        """Move ``part``'s correction, and its cell's at ``inner``, toward ``ratio``: the mean of the
        observations so far and the prior (the calibration as :data:`PRIOR_OBSERVATIONS` observations
        when it was quiet, as none when it was busy: the first observation then replaces it), and past
        ``1 / CORRECTION_WEIGHT`` of them a moving average that follows drift."""
        lo, hi = (math.log(x) for x in CORRECTION_RANGE)
        observed = min(hi, max(lo, math.log(ratio)))
        prior = PRIOR_OBSERVATIONS if self.trusted else 0

        def mean(old: float, n: int) -> float:  # n: observations before this one
            return old + max(CORRECTION_WEIGHT, 1 / (prior + n + 1)) * (observed - old)

        n = self.seen.get(part, 0)
        before = self.correction[part] if n else math.log(self._factor(part))  # unmeasured: what it borrowed
        self.correction[part] = mean(before, n)
        if inner is not None:  # a cell starts from the calibration's value, as corrected for its part so far
            cells, counts = self.cells.setdefault(part, {}), self.cell_seen.setdefault(part, {})
            k = counts.get(inner, 0)
            cells[inner] = mean(cells.get(inner, before), k)
            counts[inner] = k + 1
        self.seen[part] = n + 1
        if (
            self.disagreed is None
            and self.seen[part] >= DISAGREE_AFTER
            and not DISAGREE[0] <= math.exp(self.correction[part]) <= DISAGREE[1]
        ):
            self.disagreed = part
            if self.on_disagree is not None:
                self.on_disagree(part, math.exp(self.correction[part]))

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "key": self.key,
            "calibration_s": self.calibration_s,
            "catch_up": dict(self.catch_up),
            "noise": {"others_cpu": self.noise.others_cpu, "spread": self.noise.spread},
            "verify": {str(b): {str(w): s for w, s in row.items()} for b, row in self.verify.items()},
            "draft": {
                name: {str(r): {str(k): s for k, s in row.items()} for r, row in grid.items()}
                for name, grid in self.draft.items()
            },
        }

    @staticmethod
    def from_json(data: dict) -> "CostModel":
        grid = lambda g: {int(o): {int(i): float(s) for i, s in row.items()} for o, row in g.items()}  # noqa: E731
        return CostModel(
            grid(data["verify"]),
            {n: grid(g) for n, g in data["draft"].items()},
            {n: float(c) for n, c in data.get("catch_up", {}).items()},
            data.get("key", ""),
            data.get("calibration_s", 0.0),
            Noise(**data.get("noise", {})),
        )


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators):
    a step never gets cheaper with more tokens, whatever noise a shared machine added to one point."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _monotone(grid: Grid) -> Grid:
    return {o: dict(zip(sorted(row), isotonic([row[i] for i in sorted(row)]))) for o, row in grid.items()}


def grid_points(limit: int, points: tuple[int, ...]) -> list[int]:
    """The grid's values up to ``limit``, always including 1 and ``limit`` itself."""
    return sorted({1, limit, *(p for p in points if p <= limit)})


BATCHES = (1, 2, 4, 8, 16, 32, 64)
WIDTHS = (1, 2, 3, 5, 9, 17, 33)
FINE_BATCHES = 2  # batches up to this one are measured at every width ...
FINE_WIDTHS = 9  # ... up to this one: the draft lengths the selector mostly chooses among, plus one
FORMAT = 2  # the cached file's layout and grid: a file of another format is measured again
DRAFT_LENGTHS = (1, 2, 4, 8, 16)
PROMPT_LEN = 64  # tokens of context the calibration runs at
CATCH_UP_LEN = 256  # tokens of the history a late-starting drafter reads in the calibration


def widths_at(batch: int, max_width: int) -> list[int]:
    """The verify widths calibrated at ``batch``: every one up to :data:`FINE_WIDTHS` at batches up to
    :data:`FINE_BATCHES` (where a width's cost is a staircase, and the selector chooses), the coarse
    grid above them and at larger batches."""
    coarse = grid_points(max_width, WIDTHS)
    if batch > FINE_BATCHES:
        return coarse
    return sorted({*coarse, *range(1, min(max_width, FINE_WIDTHS) + 1)})


@dataclass
class _View:  # a SequenceView for calibration proposals
    slot: int
    token_ids: list[int]
    params: object
    generator: torch.Generator


def _best(
    fn: Callable[[], object],
    reps: int,
    sync: Callable[[], None],
    prepare: Callable[[], None] = lambda: None,
    spreads: list[float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The fastest of ``reps`` timed calls; ``spreads`` gets median / fastest."""
    times = []
    for _ in range(reps):
        prepare()
        sync()
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    if spreads is not None and min(times) > 0:
        spreads.append(statistics.median(times) / min(times))
    return min(times)


def judge(cpu: "CpuShare", spreads: list[float]) -> Noise:
    """How quiet the machine was over a calibration: what other processes used, how far repeats spread."""
    return Noise(cpu.others(), statistics.median(spreads) if spreads else 1.0)


class CpuShare:
    """The share of all CPUs that processes other than this one used between construction and
    :meth:`others` (from /proc/stat through psutil; 0 where it cannot be read)."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            import psutil

            total = psutil.cpu_times()
            busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
            own = psutil.Process().cpu_times()
            return time.monotonic(), busy, own.user + own.system
        except Exception:  # noqa: BLE001 - no /proc, no psutil: nothing to judge by
            return None

    def others(self) -> float:
        end = self._read()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return 0.0
        import os

        wall, busy, own = (e - s for e, s in zip(end, self._start))
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1)))


@torch.inference_mode()
def calibrate(
    target,
    drafters: dict,
    max_batch: int,
    max_width: int,
    max_k: int,
    max_context: int,
    reps: int = 3,
    prompt_len: int = PROMPT_LEN,
    progress: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Measure ``v(batch, width)`` of ``target`` (at :func:`widths_at`) and ``draft(name, rows, k)`` of
    each drafter in ``drafters`` (name -> drafter) on a synthetic prompt in slots
    ``0 .. max_batch - 1`` with room for ``max_context`` tokens, and how quiet the machine was
    meanwhile. The runner and drafters must hold no sequences (the engine calls this before admitting
    any). ``progress``: one progress bar with an ETA on stderr. ``clock``: what times each call (a
    test's fake clock)."""
    import sys

    from tqdm import tqdm

    from specdecode.drafters.base import TargetFeatures
    from specdecode.sampling import SamplingParams

    t_start = clock()
    cpu = CpuShare()
    spreads: list[float] = []
    prompt_len = max(2, min(prompt_len, max_context // 2))
    dev = target.device
    sync = torch.cuda.synchronize if getattr(dev, "type", str(dev)) == "cuda" else (lambda: None)
    vocab = target.vocab_size
    prompt = [(17 + 7919 * i) % max(2, vocab - 1) for i in range(prompt_len)]  # varied, no repeated n-grams
    batches = grid_points(max_batch, BATCHES)
    widths = {b: widths_at(b, max_width) for b in batches}
    slots = list(range(max_batch))
    layers = tuple(sorted({layer for d in drafters.values() for layer in d.feature_layers}))
    ks = grid_points(max_k, DRAFT_LENGTHS)
    # the bar counts tokens computed per grid point (a guess of the work: the ETA's unit)
    work = sum(sum(widths[b]) for b in batches) * 2 + sum(
        len(batches) * sum(ks) + (CATCH_UP_LEN if d.lazy_start else 0) for d in drafters.values()
    )
    bar = tqdm(
        total=work,
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0,
        desc="calibrating step costs",
        bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed}<{remaining}",
    )
    feats = target.prefill(slots, [prompt[:-1]] * max_batch, layers)

    verify: Grid = {}
    for b in batches:
        verify[b] = {}
        for w in widths[b]:
            ids = torch.tensor([prompt[-1:] + prompt[: w - 1]] * b, device=dev)
            positions = (prompt_len - 1 + torch.arange(w, device=dev))[None].expand(b, w)

            def step() -> None:
                out = target.forward(torch.arange(b, device=dev), ids, positions, layers=layers)
                target.logits(out.hidden).argmax(-1)
                for slot in range(b):
                    target.truncate(slot, prompt_len - 1)

            step() if not verify[b] else None  # warm-up: the first call of a shape pays for allocation
            verify[b][w] = _best(step, reps, sync, spreads=spreads, clock=clock)
            bar.update(2 * w)

    draft: dict[str, Grid] = {}
    catch_up: dict[str, float] = {}
    params = SamplingParams(temperature=0.0, max_new_tokens=max_k + 1)
    for name, drafter in drafters.items():
        views: list[_View] = []

        def restart() -> None:
            for s in slots:
                drafter.release(s)
            drafter.start(slots, [prompt] * max_batch)
            if drafter.feature_layers:
                drafter.observe(
                    slots,
                    [
                        TargetFeatures(0, prompt[:-1], {layer: f[layer] for layer in drafter.feature_layers})
                        for f in feats
                    ],
                )
            views[:] = [_View(s, list(prompt), params, torch.Generator().manual_seed(s)) for s in slots]

        last: list = [None]  # the last proposal

        def grow() -> None:
            # as after a step that accepted every proposed token: the sequence goes on with the proposal
            # and one more token (a drafter with a cache then feeds two); back to the prompt before the
            # context outgrows the caches
            if len(views[0].token_ids) + 3 * max_k + 4 > max_context:
                restart()
                last[0] = None
            starts = [len(v.token_ids) - 1 for v in views]  # each pending token's position
            for i, v in enumerate(views):
                p = last[0]
                if p is not None and i < p.tokens.shape[0]:
                    v.token_ids += p.tokens[i, : int(p.num_tokens[i])].tolist()
                v.token_ids.append((v.token_ids[-1] + 7919) % vocab)
            if drafter.feature_layers:  # what the target cached: the old pending token and the accepted ones
                observed = []
                for v, start, f in zip(views, starts, feats):
                    ids = v.token_ids[start:-1]
                    rows = torch.arange(len(ids)) % (prompt_len - 1)  # stand-in values: cost does not depend on them
                    observed.append(
                        TargetFeatures(
                            start, ids, {layer: f[layer][rows.to(f[layer].device)] for layer in drafter.feature_layers}
                        )
                    )
                drafter.observe(slots, observed)

        def call(r: int, k: int) -> None:
            last[0] = drafter.propose(views[:r], [k] * r)

        if drafter.lazy_start:  # what reading a history late costs, per token
            n = max(2, min(CATCH_UP_LEN, max_context - 1))
            history = [(17 + 7919 * i) % max(2, vocab - 1) for i in range(n)]
            release = lambda: drafter.release(slots[0])  # noqa: E731
            release()
            drafter.start(slots[:1], [history])  # warm-up
            catch_up[name] = _best(lambda: drafter.start(slots[:1], [history]), reps, sync, release, spreads, clock) / (
                n - 1
            )
            release()
            bar.update(CATCH_UP_LEN)
        restart()
        grid: Grid = {}
        for r in batches:
            grid[r] = {}
            for k in ks:
                if not grid[r]:
                    grow()
                    call(r, k)
                grid[r][k] = _best(functools.partial(call, r, k), reps, sync, grow, spreads, clock)
                bar.update(k)
        for s in slots:
            drafter.release(s)
        draft[name] = grid
    for s in slots:
        target.truncate(s, 0)
    bar.close()
    noise = judge(cpu, spreads)
    return CostModel(
        _monotone(verify),
        {name: _monotone(g) for name, g in draft.items()},
        catch_up,
        calibration_s=clock() - t_start,
        noise=noise,
    )


def cached(
    key: str,
    measure: Callable[[], CostModel],
    cache_dir: Path | None = None,
    recalibrate: bool = False,
    say: Callable[[str], None] = lambda line: None,
) -> CostModel:
    """The cost model stored under ``key`` in ``<cache>/calibration`` (in this :data:`FORMAT`), else
    ``measure()``'s, stored only when the machine was quiet while it was measured. A stored one that the run's steps contradict
    (:data:`DISAGREE`) is removed, so the next start measures again. ``say``: one line for the user
    on each of these events."""
    from specdecode.fsutil import make_readable
    from specdecode.models.fetch import cache_root

    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = (cache_dir or cache_root()) / "calibration" / f"cost-{digest}.json"

    def forget(part: str, ratio: float) -> None:
        path.unlink(missing_ok=True)
        say(
            f"auto: this run's {part} steps take {ratio:.2f}x what the cached calibration says; it adapts "
            "now and measures again at the next start"
        )

    if path.is_file() and not recalibrate:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("key") == key and data.get("format") == FORMAT:  # (another grid: measured again)
                model = CostModel.from_json(data)
                if model.trusted:
                    model.on_disagree = forget
                    return model
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again
    model = measure()
    model.key = key
    if not model.trusted:
        path.unlink(missing_ok=True)
        say(
            f"auto: the machine was busy while calibrating ({model.noise.describe()}): these costs are a prior "
            "that this run corrects from its own steps; not cached, measured again at the next start"
        )
        return model
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_json(), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    make_readable(path)
    model.on_disagree = forget
    return model
