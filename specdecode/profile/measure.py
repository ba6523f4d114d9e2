"""Timing forwards through the runner protocol: what a speculative step pays on this machine and backend.

Each model gets a runner with ``context`` tokens in slot 0 (synthetic ids: a dense model's forward costs the
same whatever the tokens). Then, in rounds (every model and width in each round, so drift on a shared
machine hits them alike), each width ``n`` is timed twice after that context and rolled back:

* ``step``: ``runner.forward`` of ``n`` tokens and ``runner.logits`` of every row (what a verify of ``n - 1``
  drafts runs; ``n = 1`` is a decode step);
* ``layers``: ``runner.prefill`` of the same ``n`` tokens (the layers without the output layer: no logits), so
  ``step - layers`` is the output layer with whatever the runner does to hand its rows over (llama.cpp: the
  copy of ``n`` x vocabulary floats out of its buffer).

One warm-up round is not counted; its length decides how many rounds fit the rest of the time budget. The medians go
into a :class:`~specdecode.profile.result.ModelCost`. The clock is injected (tests count simulated seconds).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.profile.result import CONTEXT, ModelCost

WIDTHS = tuple(range(1, 10))  # target: n = 1..9 tokens per forward (k <= 8 drafts)
DRAFT_WIDTHS = (1,)  # a draft model proposes one token per forward
MIN_ROUNDS, MAX_ROUNDS = 3, 25

Clock = Callable[[], float]


@dataclass
class Probe:
    """One model's runner with a context in slot 0, and its timings by kind and width."""

    spec: str
    fingerprint: str
    runner: object  # specdecode.models.base.Runner
    widths: tuple[int, ...]
    context: int = CONTEXT
    clock: Clock = time.perf_counter
    samples: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = self.runner
        r.ensure_capacity(1, self.context + max(self.widths) + 8)
        vocab = max(2, r.vocab_size - 1)
        self.tokens = [(17 + 7919 * i) % vocab for i in range(self.context + max(self.widths))]
        r.prefill([0], [self.tokens[: self.context]])
        self._slot = torch.tensor([0], device=r.device)
        cuda = getattr(r.device, "type", "cpu") == "cuda"
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.samples = {"step": {n: [] for n in self.widths}, "layers": {n: [] for n in self.widths}}

    def _ids(self, n: int) -> list[int]:
        return self.tokens[self.context : self.context + n]

    @torch.inference_mode()
    def step(self, n: int) -> float:
        """Seconds of one forward of ``n`` tokens with every row's logits."""
        r, dev = self.runner, self.runner.device
        ids = torch.tensor([self._ids(n)], device=dev)
        positions = torch.arange(self.context, self.context + n, device=dev)[None]
        self._sync()
        t0 = self.clock()
        r.logits(r.forward(self._slot, ids, positions).hidden)
        self._sync()
        elapsed = self.clock() - t0
        r.truncate(0, self.context)
        return elapsed

    @torch.inference_mode()
    def layers(self, n: int) -> float:
        """Seconds of the same ``n`` tokens through the layers only (a prefill: no output layer)."""
        self._sync()
        t0 = self.clock()
        self.runner.prefill([0], [self._ids(n)], starts=[self.context])
        self._sync()
        elapsed = self.clock() - t0
        self.runner.truncate(0, self.context)
        return elapsed

    def round(self, record: bool = True) -> None:
        for n in self.widths:
            layers, step = self.layers(n), self.step(n)
            if record:
                self.samples["layers"][n].append(layers)
                self.samples["step"][n].append(step)

    def cost(self, description: str) -> ModelCost:
        med = {kind: {n: statistics.median(ts) for n, ts in d.items() if ts} for kind, d in self.samples.items()}
        return ModelCost(
            self.spec,
            self.fingerprint,
            description,
            med["step"],
            med["layers"],
            len(self.samples["step"][self.widths[0]]),
        )

    def spreads(self) -> list[float]:
        """Per measured cell: median repeat / fastest repeat (how far a busy machine moved them)."""
        return [
            statistics.median(ts) / min(ts) for d in self.samples.values() for ts in d.values() if ts and min(ts) > 0
        ]


def rounds_for(budget_s: float, round_s: float) -> int:
    """How many rounds of ``round_s`` seconds fit ``budget_s`` (at least MIN_ROUNDS, at most MAX_ROUNDS)."""
    if round_s <= 0:
        return MAX_ROUNDS
    return max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget_s / round_s)))


def run_rounds(
    probes: list[Probe], budget_s: float, clock: Clock = time.perf_counter, progress: str | None = None
) -> tuple[int, float]:
    """One warm-up round, then as many rounds of every probe as fit what is left of ``budget_s`` seconds; the
    rounds run and the seconds they took. ``progress``: a bar with an ETA on stderr under that name."""
    from tqdm import tqdm

    t0 = clock()
    for p in probes:
        p.round(record=False)
    warm_up = clock() - t0
    rounds = rounds_for(budget_s - warm_up, warm_up)  # the warm-up counts against the budget
    bar = tqdm(
        total=rounds,
        disable=progress is None,
        file=sys.stderr,
        mininterval=1.0,
        desc=progress,
        bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed}<{remaining}",
    )
    t1 = clock()
    for _ in range(rounds):
        for p in probes:
            p.round()
        bar.update(1)
    bar.close()
    return rounds, clock() - t1
