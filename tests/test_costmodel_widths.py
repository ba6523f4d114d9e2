"""Verify cost per width: the calibration measures every width where the selector chooses, the cost model
answers a measured width with its measurement (a straight line only across the coarse grid's gaps), a
cached calibration of another format is measured again, and ``auto`` takes the length whose width is cheap
on a repack-like staircase, where a linear cost would take the next one. Costs come from a fake clock that
a wrapped tiny runner advances per forward, or are written down directly: nothing here reads wall time."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from specdecode import costmodel
from specdecode.costmodel import FINE_BATCHES, FINE_WIDTHS, WIDTHS, CostModel, widths_at
from specdecode.drafters.ngram import NgramDrafter
from specdecode.models.hf import HFRunner
from specdecode.selector import AutoPolicy, Counts, SelectorSettings, best_lengths
from tiny import make_model

V = 32


def repack(tokens: int) -> float:
    """Seconds of a forward of ``tokens`` tokens on a repack-like kernel: one token takes the matrix-vector
    path; more take the columns in groups of four, each group a pass over the weights."""
    return 1.0 if tokens == 1 else 1.2 * math.ceil(tokens / 4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A runner whose forwards advance ``clock`` by ``cost(batch * width)`` (it still computes them)."""

    def __init__(self, runner: HFRunner, clock: FakeClock, cost=repack) -> None:
        self.runner, self.clock, self.cost = runner, clock, cost
        self.forwards: list[tuple[int, int]] = []  # (batch, width) of each forward

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, slots, input_ids, positions, **kw):
        batch, width = input_ids.shape
        self.forwards.append((batch, width))
        self.clock.now += self.cost(batch * width)
        return self.runner.forward(slots, input_ids, positions, **kw)


def calibrated(max_batch: int, max_width: int, reps: int = 2) -> tuple[CostModel, Timed]:
    """A calibration of a repack-like runner (and n-gram lookup, which runs no forward: free) on a fake clock."""
    clock = FakeClock()
    runner = Timed(HFRunner(make_model(V, seed=0), max_batch, 64), clock)
    parts = {"ngram": NgramDrafter()}
    cm = costmodel.calibrate(
        runner, parts, max_batch, max_width, max_width - 1, 64, reps=reps, prompt_len=16, clock=clock
    )
    return cm, runner


def test_small_batches_are_measured_at_every_width_larger_ones_on_the_coarse_grid():
    assert widths_at(1, 17) == [*range(1, FINE_WIDTHS + 1), 17]
    assert widths_at(FINE_BATCHES, 4) == [1, 2, 3, 4]
    assert widths_at(FINE_BATCHES + 1, 17) == [w for w in WIDTHS if w <= 17]  # (a multiple of 4 rows: no staircase)
    cm, runner = calibrated(max_batch=4, max_width=9)
    assert {b: sorted(row) for b, row in cm.verify.items()} == {
        1: list(range(1, 10)),
        2: list(range(1, 10)),
        4: [1, 2, 3, 5, 9],
    }
    # what the fine rows add: each of their widths missing from the coarse grid, times the repeats (a warm-up per row)
    assert len(runner.forwards) == sum(1 + 2 * len(widths_at(b, 9)) for b in (1, 2, 4))
    assert len(runner.forwards) - sum(1 + 2 * len(widths_at(4, 9)) for _ in (1, 2, 4)) == 2 * 2 * 4
    # the staircase survives the calibration: width 4 costs what width 2 does, width 5 twice that
    assert [cm.verify_s(1, w) for w in range(1, 10)] == pytest.approx([repack(w) for w in range(1, 10)])
    assert cm.verify_s(2, 4) == pytest.approx(repack(8)) and cm.verify_s(2, 5) == pytest.approx(repack(10))


def test_a_measured_width_is_its_measurement_and_only_the_coarse_gaps_are_straight_lines():
    cm = CostModel({1: {1: 1.0, 2: 1.2, 3: 1.2, 4: 1.2, 5: 2.4, 9: 3.6}}, {})
    assert cm.verify_s(1, 4) == 1.2 and cm.verify_s(1, 5) == 2.4  # measured: no line through 3 and 5
    assert cm.verify_s(1, 7) == pytest.approx(3.0)  # the gap between 5 and 9: linear
    assert cm.verify_s(1, 13) == pytest.approx(4.8)  # past the last point: the last slope
    # control: the coarse grid alone puts width 4 halfway between 3 and 5, hiding the cheap width
    assert CostModel({1: {1: 1.0, 2: 1.2, 3: 1.2, 5: 2.4, 9: 3.6}}, {}).verify_s(1, 4) == pytest.approx(1.8)


def linear(step: float = 1.0, per_token: float = 0.2) -> CostModel:
    return CostModel({1: {w: step + per_token * (w - 1) for w in range(1, 18)}}, {"ngram": {1: {1: 0.0, 16: 0.0}}})


def staircase() -> CostModel:
    return CostModel({1: {w: repack(w) for w in range(1, 18)}}, {"ngram": {1: {1: 0.0, 16: 0.0}}})


def chosen(cost: CostModel, alpha: float, max_k: int = 8) -> int:
    """The length ``auto`` drafts a lone sequence at, a free drafter's acceptance ``alpha`` (every token proposed)."""
    history = {"ngram": Counts.guess(alpha, 1.0, 1e6)}
    policy = AutoPolicy(["ngram"], cost, max_k=max_k, settings=SelectorSettings(explore_every=0), history=history)
    return policy.plan([SimpleNamespace(token_ids=[1, 2, 3])], 1).lengths[0]


def test_auto_drafts_the_length_whose_width_is_cheap():
    # k = 3 verifies a width as cheap as width 2; k = 4 starts a second group of columns and costs twice that
    assert chosen(staircase(), 0.8) == 3
    assert chosen(linear(), 0.8) == 4  # control: on a line the same acceptance takes one more token
    # the same through the calibration: a fake clock on a repack-like runner, then the plan
    cm, _ = calibrated(max_batch=1, max_width=9)
    assert chosen(cm, 0.8) == 3
    # a length whose width opens a group is never best: the group's widest width costs the same and drafts more
    lengths = SelectorSettings().lengths
    picks = {
        best_lengths(staircase(), [{"ngram": (a / 100, 1.0)}], 1, ["ngram"], lengths, 0.03)["ngram"]
        for a in range(30, 100)
    }
    assert 3 in picks and picks & {4, 5, 6} == set()


def test_a_cached_calibration_of_another_format_is_measured_again(tmp_path):
    measured = []

    def measure() -> CostModel:
        measured.append(1)
        return staircase()

    costmodel.cached("k", measure, tmp_path)
    (path,) = (tmp_path / "calibration").glob("cost-*.json")
    assert json.loads(path.read_text())["format"] == costmodel.FORMAT
    costmodel.cached("k", measure, tmp_path)
    assert len(measured) == 1  # the stored one is read back
    old = json.loads(path.read_text())
    del old["format"]  # what an earlier version (the coarse grid only) wrote
    path.write_text(json.dumps(old))
    model = costmodel.cached("k", measure, tmp_path)
    assert len(measured) == 2 and json.loads(path.read_text())["format"] == costmodel.FORMAT
    assert model.verify_s(1, 4) == pytest.approx(repack(4))
