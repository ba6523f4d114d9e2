"""``--draft-policy auto``: before each step, choose for every sequence which drafter drafts for it and
how many tokens (or none), maximising the whole batch's expected tokens per second.

The model (constants are :class:`SelectorSettings` fields; why each default was chosen is in
docs/benchmarks.md):

* **Cost** (:mod:`specdecode.costmodel`): seconds of the target's verify step ``v(B, width)``, of a
  drafter's proposal ``draft(d, rows, k)``, and of a drafter's catch-up on ``n`` tokens it has not
  read, ``catch_up(d, n)``; measured at start, corrected online from every step's measured times.
* **Acceptance**, per sequence and drafter (:func:`estimate`): a per-token acceptance rate ``alpha``
  and a *fill* rate (the share of requested tokens the drafter proposed). Each is a ratio of
  discounted counts (:class:`Counts`: an observation counts 1, older ones decay by ``decay`` per
  observation) plus a prior: the drafter's history over all sequences (decaying by ``prior_decay``)
  worth ``prior_weight`` = 10 tokens. Before any observation the history is a guess
  (``prior_alpha``, ``prior_fill``) worth ``guess_weight`` tokens. A step that drafted ``n`` and
  accepted ``a`` adds ``a`` acceptances and, when ``a < n``, one rejection. A *free* drafter (no
  model: n-gram lookup) is also asked every step what it would propose for the sequences it does not
  draft for, and that proposal's prefix matching the emitted tokens counts as accepted
  (:func:`shadow_score`; unbiased, greedy or sampled: a point-mass draft token is accepted with the
  same probability ``p_target(token)`` with which the emitted token equals it).
* **Expected tokens** of a chain of ``k`` (:func:`expected_tokens`): ``1 + fill * (alpha + ... + alpha^k)``.
* **Step cost** of a plan (:func:`step_seconds`): ``v(B, 1 + max k) + sum_d draft(d, rows_d, k_d)``.
* **The plan** (:func:`best_lengths`, :func:`assign`): one length per drafter (``0`` = unused),
  chosen by two rounds of coordinate ascent from "nothing drafts" to maximise the batch's expected
  tokens per second, on the measured cost of each verify width (a length whose width is cheap on this
  backend wins over a longer one whose width starts a new group of columns); each sequence takes the drafter that promises it most at that drafter's
  length. Drafting is chosen only when it beats plain decoding by ``margin`` (3 %).
* **Catch-up** (:func:`pays_back`): a drafter that must first read ``lag`` tokens of a sequence (a
  draft model starting late) is a candidate for it only if
  ``(remaining - delay) * (ready - best) > (1 + catch_up_margin) * B * catch_up(d, lag)``:
  ``remaining`` its tokens left (at most ``horizon`` = 256), ``best`` the seconds per token it would
  get with the drafter at its best length, ``ready`` the best it gets without any catch-up (plain
  decoding or a drafter in step, judged on undiscounted counts over the whole request), ``B`` the
  batch (everyone waits for the catch-up), ``catch_up_margin`` = 1 (a forecast saving must be twice
  a measured cost). Beside other sequences a backlog longer than ``catch_up_tokens`` (at least
  ``max_k + 2``) is read that many tokens a step, shared in batch order, while the sequence takes
  the best plan without that drafter; ``delay`` (:func:`steps_to_read`) prices those steps. Alone,
  a sequence reads its backlog at once. A catch-up costing ``n`` plain steps waits until every free
  drafter has been scored on ``min(look_steps, look_share * n)`` (3, a quarter) of the sequence's
  steps (:func:`look_first`).
* **Exploration** (:func:`exploration`): every ``explore_every`` = 16 steps of a sequence (and at
  the first chance for a drafter never tried anywhere), a drafter it has not used for that long
  drafts for it once, at its planned length or ``explore_k``, unless it could not pay even if always
  right (:func:`could_pay`, :func:`pays_back` at ``alpha = 0.999``, catch-up included), the sequence
  is still being watched before a catch-up, or what it adds to the step exceeds
  :func:`exploration_allowance`: ``explore_cost * explore_every / B`` of the step's seconds
  (``explore_cost`` = 5 %: exploration costs the batch about 5 % of its time at most). A drafter never
  tried anywhere is explored once whatever the allowance (one step learns what it is worth for the
  rest of the run), and after a busy machine's calibration (:class:`specdecode.costmodel.Noise`) one
  whose cost the run has not timed is explored whatever :func:`could_pay` and :func:`pays_back` say of
  that prior.

It only changes which tokens are proposed and how many: verification is exact for any proposal, so
the output law is the target's whatever it decides. :func:`auto_drafting` builds the multi-drafter
and its selector together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Mapping, Protocol, Sequence, cast

from specdecode.config import default
from specdecode.costmodel import FINE_WIDTHS, CostModel
from specdecode.policy import Plan as StepPlan
from specdecode.policy import Read

if TYPE_CHECKING:
    from specdecode.drafters.base import Drafter
    from specdecode.drafters.multi import MultiDrafter

log = logging.getLogger("specdecode.selector")

CATCH_UP_TOKENS = default("catch_up_tokens")  # backlog tokens read per step while others wait for it
Estimate = tuple[float, float]  # (alpha, fill)
Choice = tuple["str | None", int]  # (drafter, length); (None, 0): no drafting
Rows = dict[tuple[str, int], int]  # (drafter, length) -> rows of the step drafting that


@dataclass(frozen=True)
class SelectorSettings:
    """The selector's constants (see the module docstring for what each does)."""

    # chain lengths tried (those <= max_k, and max_k): every one whose verify width the calibration measures
    # at small batches (a cheap width is then found wherever it is), sparser beyond
    lengths: tuple[int, ...] = (*range(1, FINE_WIDTHS), 12, 16)
    margin: float = 0.03  # drafting must beat plain decoding by this share
    decay: float = 0.7  # per-observation decay of a sequence's own counts
    prior_decay: float = 0.98  # per-observation decay of a drafter's history over all sequences
    prior_weight: float = 10.0  # the history counts as this many accepted-or-rejected tokens of a sequence's own
    prior_alpha: float = 0.5  # a drafter's guessed acceptance before any observation
    prior_fill: float = 0.8  # ... and fill
    guess_weight: float = 3.0  # the guess counts as this many tokens of history: real observations outweigh it
    explore_every: int = 16  # steps of a sequence between explorations of a drafter it does not use (0: never)
    explore_k: int = 2  # length explored at when the plan gives the drafter none
    explore_cost: float = 0.05  # share of the batch's time exploration may cost
    horizon: int = 256  # remaining tokens a catch-up may be paid back over
    catch_up_margin: float = 1.0  # a catch-up must be expected to save (1 + this) times what it costs
    look_steps: int = 3  # steps free drafters are scored on before a dear catch-up (at most) ...
    look_share: float = 0.25  # ... and at most this share of the catch-up's cost in plain steps

    def __post_init__(self) -> None:
        if self.explore_cost < 0:
            raise ValueError(f"explore_cost must be >= 0, got {self.explore_cost}")
        if self.look_steps < 0 or self.look_share < 0:
            raise ValueError(f"look_steps and look_share must be >= 0, got {self.look_steps}, {self.look_share}")
        if self.catch_up_margin < 0:
            raise ValueError(f"catch_up_margin must be >= 0, got {self.catch_up_margin}")


# -- acceptance ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Counts:
    """Discounted evidence about one drafter (for one sequence, or over all of them)."""

    accepted: float = 0.0
    rejected: float = 0.0
    proposed: float = 0.0
    requested: float = 0.0

    def add(self, requested: int, drafted: int, accepted: int, decay: float, compared: int | None = None) -> "Counts":
        """These counts decayed by ``decay``, plus one step. ``compared``: how many of the drafted
        tokens could be judged (a shadow proposal longer than what the step emitted is censored
        there: no rejection seen); default all of them."""
        return Counts(
            decay * self.accepted + accepted,
            decay * self.rejected + (1 if accepted < (drafted if compared is None else compared) else 0),
            decay * self.proposed + drafted,
            decay * self.requested + requested,
        )

    @staticmethod
    def guess(alpha: float, fill: float, weight: float) -> "Counts":
        """Counts worth ``weight`` tokens whose rates are ``alpha`` and ``fill``."""
        return Counts(alpha * weight, (1 - alpha) * weight, fill * weight, weight)


def estimate(own: Counts, history: Counts, prior_weight: float) -> Estimate:
    """(alpha, fill): ``own`` counts plus the rates of ``history`` worth ``prior_weight`` tokens."""
    prior_alpha = history.accepted / max(history.accepted + history.rejected, 1e-9)
    prior_fill = history.proposed / max(history.requested, 1e-9)
    alpha = (own.accepted + prior_weight * prior_alpha) / (own.accepted + own.rejected + prior_weight)
    fill = (own.proposed + prior_weight * prior_fill) / (own.requested + prior_weight)
    return min(alpha, 0.999), min(fill, 1.0)


def shadow_score(proposed: Sequence[int], emitted: Sequence[int]) -> tuple[int, int]:
    """(matched, compared) of a free drafter's shadow proposal against the tokens the step emitted:
    the matched prefix counts as accepted; past what was emitted nothing is judged."""
    compared = min(len(proposed), len(emitted))
    matched = next((i for i in range(compared) if proposed[i] != emitted[i]), compared)
    return matched, compared


def expected_tokens(alpha: float, fill: float, k: int) -> float:
    """Tokens a step emits for a chain of ``k`` with per-token acceptance ``alpha``."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= alpha
        total += term
    return 1.0 + fill * total


# -- cost -------------------------------------------------------------------------------------------------
def tried_lengths(lengths: Sequence[int], max_k: int) -> tuple[int, ...]:
    """The chain lengths the plan tries: ``lengths`` up to ``max_k``, and ``max_k``."""
    return tuple(sorted({k for k in lengths if k <= max_k} | {max_k}))


def moved(rows: Rows, old: Choice, new: Choice) -> Rows:
    """``rows`` with one row going from choice ``old`` to ``new``."""
    out = dict(rows)
    for (d, k), n in ((old, -1), (new, 1)):
        if d is not None and k > 0:
            out[(d, k)] = out.get((d, k), 0) + n
            if not out[(d, k)]:
                del out[(d, k)]
    return out


def plan_rows(choices: Sequence[Choice]) -> Rows:
    rows: Rows = {}
    for choice in choices:
        rows = moved(rows, (None, 0), choice)
    return rows


def step_seconds(cost: CostModel, batch: int, rows: Rows) -> float:
    """Seconds of a step of ``batch`` sequences, ``rows`` of them drafting: one verify as wide as the
    longest chain, and each drafter's proposal for its rows (padded to its widest chain)."""
    width = 1 + max((k for _, k in rows), default=0)
    return cost.verify_s(batch, width) + sum(cost.draft_s(d, n, k) for (d, k), n in rows.items())


def seconds_per_token(cost: CostModel, drafter: str, est: Estimate, batch: int, lengths: Sequence[int]) -> float:
    """Seconds per token of one sequence drafting with ``drafter`` at its best length (at ``est``)."""
    return min((cost.verify_s(batch, k + 1) + cost.draft_s(drafter, 1, k)) / expected_tokens(*est, k) for k in lengths)


def could_pay(cost: CostModel, drafter: str, batch: int, lengths: Sequence[int], margin: float) -> bool:
    """Would ``drafter`` beat plain decoding for a whole batch if it were always right?"""
    plain = batch / cost.verify_s(batch, 1)
    for k in lengths:
        seconds = cost.verify_s(batch, k + 1) + cost.draft_s(drafter, batch, k)
        if batch * (k + 1) / seconds > plain * (1 + margin):
            return True
    return False


# -- catch-up ---------------------------------------------------------------------------------------------
def pays_back(
    catch_up_s: float, remaining: int, ready: float, best: float, batch: int, margin: float, delay: int = 0
) -> bool:
    """Does a catch-up of ``catch_up_s`` seconds (the whole batch waits for it) pay back: a sequence
    with ``remaining`` tokens, less ``delay`` steps spent reading in pieces, saving ``ready - best``
    seconds a token, saves ``1 + margin`` times what the catch-up costs the batch?"""
    if catch_up_s <= 0:
        return True
    return (remaining - delay) * (ready - best) > (1 + margin) * catch_up_s * max(1, batch)


def read_chunk(batch: int, catch_up_tokens: int | None, max_k: int) -> int | None:
    """Backlog tokens read per step beside other sequences (None: whole, at once). At least
    ``max_k + 2``: more than a step can add to a backlog, so reading always gets ahead."""
    if batch <= 1 or catch_up_tokens is None:
        return None
    return max(catch_up_tokens, max_k + 2)


def steps_to_read(lag: int, chunk: int | None) -> int:
    """About how many steps a sequence decodes without a drafter while it reads a backlog of ``lag``
    in pieces of ``chunk`` (the sequence itself adds about a token a step meanwhile)."""
    return 0 if chunk is None or lag <= chunk else -(-lag // (chunk - 1))


def look_first(
    catch_up: Mapping[str, float],
    looks: Mapping[str, int],
    free: Sequence[str],
    plain_s: float,
    batch: int,
    look_steps: int,
    look_share: float,
) -> bool:
    """Should a sequence watch the free drafters longer before any catch-up? Yes while its dearest
    catch-up costs ``n`` plain steps (``plain_s`` each) of the batch and some free drafter has been
    scored (``looks``) on fewer than ``min(look_steps, look_share * n)`` of its steps."""
    dearest = max(catch_up.values(), default=0.0)
    if dearest <= 0 or not free:
        return False
    steps = dearest * max(1, batch) / max(plain_s, 1e-9)
    need = min(look_steps, int(look_share * steps))
    return any(looks.get(d, 0) < need for d in free)


# -- the plan ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outlook:
    """What the plan knows of one sequence at this step."""

    known: dict[str, Estimate]  # drafter -> discounted (alpha, fill): picks this step's drafter
    lag: dict[str, int]  # drafter -> tokens it must read before drafting for the sequence
    catch_up: dict[str, float]  # drafter -> seconds of that reading (0: none)
    delay: dict[str, int]  # drafter -> steps spent reading in pieces first (steps_to_read)
    ready: float  # seconds per token the sequence gets without any catch-up
    looking: bool  # still watching the free drafters before a dear catch-up
    remaining: int  # tokens it may still emit (at most the horizon)


def ready_seconds(cost: CostModel, batch: int, whole: Mapping[str, Estimate], lengths: Sequence[int]) -> float:
    """Seconds per token without any catch-up: plain decoding, or the best of the drafters in step
    (``whole``: their estimates over the whole request so far)."""
    return min([cost.verify_s(batch, 1)] + [seconds_per_token(cost, d, e, batch, lengths) for d, e in whole.items()])


def candidates(
    o: Outlook, cost: CostModel, batch: int, lengths: Sequence[int], catch_up_margin: float
) -> dict[str, Estimate]:
    """The drafters that may draft for the sequence at this step (with their estimates): in step, or
    not waiting to watch the free drafters and with a catch-up that pays back."""
    return {
        d: e
        for d, e in o.known.items()
        if o.catch_up[d] <= 0
        or (
            not o.looking
            and pays_back(
                o.catch_up[d],
                o.remaining,
                o.ready,
                seconds_per_token(cost, d, e, batch, lengths),
                batch,
                catch_up_margin,
                o.delay[d],
            )
        )
    }


def assign(est: Mapping[str, Estimate], lengths: Mapping[str, int]) -> Choice:
    """The drafter (at its length) that promises the most tokens among those in ``est``."""
    best: Choice = (None, 0)
    gain = 1.0
    for d, k in lengths.items():
        if k > 0 and d in est:
            e = expected_tokens(*est[d], k)
            if e > gain:
                best, gain = (d, k), e
    return best


def plan_rate(cost: CostModel, est: Sequence[Mapping[str, Estimate]], lengths: Mapping[str, int], batch: int) -> float:
    """Expected tokens per second of a step of ``batch`` sequences (``est`` covers the drafting ones)."""
    choices = [assign(e, lengths) for e in est]
    tokens: float = batch - len(est)  # sequences not planned here emit one token each
    tokens += sum(expected_tokens(*e[d], k) if d is not None else 1.0 for e, (d, k) in zip(est, choices))
    return tokens / max(step_seconds(cost, batch, plan_rows(choices)), 1e-12)


def best_lengths(
    cost: CostModel,
    est: Sequence[Mapping[str, Estimate]],
    batch: int,
    drafters: Sequence[str],
    lengths: Sequence[int],
    margin: float,
) -> dict[str, int]:
    """One length per drafter (0: unused): coordinate ascent, two rounds, from nothing drafting; kept
    only if it beats plain decoding by ``margin``."""
    off = {d: 0 for d in drafters}
    base = plan_rate(cost, est, off, batch)
    best, best_rate = dict(off), base
    for _ in range(2):
        for d in drafters:
            for k in [0, *lengths]:
                trial = {**best, d: k}
                rate = plan_rate(cost, est, trial, batch)
                if rate > best_rate:
                    best, best_rate = trial, rate
    return best if best_rate > base * (1 + margin) else off


@dataclass(frozen=True)
class Plan:
    lengths: dict[str, int]  # drafter -> its length at this step (0: unused)
    choices: list[Choice]  # per sequence
    reading: dict[str, list[int]]  # drafter -> the sequences (indices, batch order) it reads ahead for


def choose(
    cost: CostModel,
    batch: int,
    outlooks: Sequence[Outlook],
    drafters: Sequence[str],
    lengths: Sequence[int],
    chunk: int | None,
    settings: SelectorSettings,
) -> Plan:
    """The step's plan. A sequence whose chosen drafter is more than ``chunk`` tokens behind has it
    read ahead instead and takes the best plan without the drafters that far behind."""
    est = [candidates(o, cost, batch, lengths, settings.catch_up_margin) for o in outlooks]
    best = best_lengths(cost, est, batch, drafters, lengths, settings.margin)
    choices = [assign(e, best) for e in est]
    reading: dict[str, list[int]] = {}
    if chunk is not None and any(d is not None and o.lag[d] > chunk for (d, _), o in zip(choices, outlooks)):
        for i, (o, (d, _)) in enumerate(zip(outlooks, choices)):
            if d is not None and o.lag[d] > chunk:
                reading.setdefault(d, []).append(i)
                est[i] = {x: e for x, e in est[i].items() if o.lag[x] <= chunk}
        best = best_lengths(cost, est, batch, drafters, lengths, settings.margin)
        choices = [assign(e, best) for e in est]
    return Plan(best, choices, reading)


# -- exploration ------------------------------------------------------------------------------------------
def exploration_allowance(step_s: float, batch: int, explore_cost: float, explore_every: int) -> float:
    """Seconds one exploration may add to a step of ``step_s``: with ``batch`` sequences each exploring
    every ``explore_every`` steps, exploration then costs at most ``explore_cost`` of the time."""
    return explore_cost * explore_every * step_s / max(1, batch)


def due_for_exploration(
    drafters: Sequence[str], tried: set[str], last_used: Mapping[str, int], steps: int, explore_every: int
) -> list[str]:
    """Drafters never tried anywhere, or not used for the sequence for ``explore_every`` steps,
    longest unused first (none when ``explore_every`` is 0)."""
    if explore_every <= 0:
        return []
    due = [d for d in drafters if d not in tried or steps - last_used.get(d, 0) >= explore_every]
    return sorted(due, key=lambda d: last_used.get(d, 0))


def exploration(
    due: Sequence[str],
    o: Outlook,
    choice: Choice,
    lengths: Mapping[str, int],
    rows: Rows,
    allowance: float,
    cost: CostModel,
    batch: int,
    tried: Sequence[int],
    explore_k: int,
    settings: SelectorSettings,
    first: Collection[str] = (),
    unproven: Collection[str] = (),
) -> tuple[tuple[str, int] | None, list[str]]:
    """The first of ``due`` worth exploring for a sequence planned at ``choice`` (None: none), and the
    drafters passed over as unable to pay or be afforded at this load (look again later). A drafter
    whose catch-up waits while the sequence is watched stays due. ``tried``: the lengths the plan
    tries; ``explore_k``: the length explored at where the plan gives the drafter none. A drafter in
    ``first`` (never tried anywhere) is explored whatever the allowance: one step, once, learns what
    it is worth for the rest of the run; one in ``unproven`` (its cost known only from a busy machine's
    calibration, never timed in this run) whether or not that cost says it could pay, or pay back its
    catch-up."""
    passed: list[str] = []
    for d in due:
        k = lengths[d] or explore_k
        if o.looking and o.catch_up[d] > 0:
            continue
        worth = d in unproven or (
            could_pay(cost, d, batch, tried, settings.margin)
            and pays_back(
                o.catch_up[d],
                o.remaining,
                o.ready,
                seconds_per_token(cost, d, (0.999, 1.0), batch, tried) if o.catch_up[d] > 0 else 0.0,
                batch,
                settings.catch_up_margin,
                o.delay[d],
            )
        )
        affordable = d in first or (
            step_seconds(cost, batch, moved(rows, choice, (d, k))) - step_seconds(cost, batch, rows) <= allowance
        )
        if worth and affordable:
            return (d, k), passed
        passed.append(d)
    return None, passed


# -- the stateful shell -----------------------------------------------------------------------------------
class PartsView(Protocol):
    """What the selector asks of the drafters it chooses among (:class:`specdecode.drafters.multi.Parts`)."""

    free: tuple[str, ...]  # parts whose proposals cost no model forward: asked for shadow proposals

    def lag(self, seq, name: str) -> int:
        """Tokens part ``name`` must read for ``seq`` before it can draft."""

    def shadow(self, seqs: list, name: str, k: int) -> list[list[int]]:
        """What free part ``name`` would propose for each of ``seqs`` at length ``k``."""


@dataclass
class _SeqState:
    counts: dict[str, Counts] = field(default_factory=dict)
    whole: dict[str, Counts] = field(default_factory=dict)  # the same, undiscounted: the request so far
    looks: dict[str, int] = field(default_factory=dict)  # drafter -> steps it was scored on (drafted or shadow)
    last_used: dict[str, int] = field(default_factory=dict)  # drafter -> step index it last drafted
    steps: int = 0
    choice: Choice = (None, 0)  # this step's (drafter, requested length)
    # free drafters not chosen this step -> (length asked, len(token_ids) at the plan, what they proposed)
    shadow: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


class AutoPolicy:
    """The selector (see the module docstring): a draft policy that also says which of ``drafters``
    drafts for each sequence (:meth:`route`). It keeps the counts, per sequence and per drafter, and
    decides with the module's pure functions. ``parts`` (None: drafters that never lag, nothing
    free) is what it asks of the drafters; ``history`` starts drafters from known counts (a drafter
    with a history counts as tried)."""

    def __init__(
        self,
        drafters: Sequence[str],
        cost: CostModel,
        parts: PartsView | None = None,
        *,
        max_k: int,
        catch_up_tokens: int | None = CATCH_UP_TOKENS,
        settings: SelectorSettings = SelectorSettings(),
        history: Mapping[str, Counts] | None = None,
    ) -> None:
        if not drafters:
            raise ValueError("the selector needs at least one drafter")
        if max_k < 1:
            raise ValueError(f"max draft length must be >= 1, got {max_k}")
        if catch_up_tokens is not None and catch_up_tokens < 1:
            raise ValueError(f"catch_up_tokens must be >= 1 (or None: whole), got {catch_up_tokens}")
        self.drafters, self.cost, self.parts, self.max_k = list(drafters), cost, parts, max_k
        self.catch_up_tokens, self.settings = catch_up_tokens, settings
        self.lengths = tried_lengths(settings.lengths, max_k)
        self.explore_k = min(settings.explore_k, max_k)
        self.free = parts.free if parts is not None else ()
        guess = Counts.guess(settings.prior_alpha, settings.prior_fill, settings.guess_weight)
        self.history = {d: guess for d in self.drafters}  # drafter -> its counts over all sequences
        self.history.update(history or {})
        self.tried = set(history or ())  # drafters with at least one real observation (drafted, or shadow-scored)
        self._seqs: dict[int, _SeqState] = {}

    def _state(self, seq) -> _SeqState:
        return self._seqs.setdefault(id(seq), _SeqState())

    def estimate(self, seq, drafter: str, whole: bool = False) -> Estimate:
        """(alpha, fill) for ``seq`` and ``drafter``: its discounted counts plus the prior; with
        ``whole``, its counts over the whole request so far (undiscounted) plus the prior."""
        state = self._state(seq)
        own = (state.whole if whole else state.counts).get(drafter, Counts())
        return estimate(own, self.history[drafter], self.settings.prior_weight)

    def _remaining(self, seq) -> int:
        params, out = getattr(seq, "params", None), getattr(seq, "output_ids", None)
        if params is None or out is None:
            return self.settings.horizon
        return max(0, min(params.max_new_tokens - len(out), self.settings.horizon))

    def _outlook(self, seq, batch: int, chunk: int | None) -> Outlook:
        s, cost = self.settings, self.cost
        lag = {d: self.parts.lag(seq, d) if self.parts is not None else 0 for d in self.drafters}
        catch = {d: cost.catch_up_s(d, n) if n > 0 else 0.0 for d, n in lag.items()}
        # judged over the whole request so far: a catch-up is a decision for the rest of the request
        whole = {d: self.estimate(seq, d, whole=True) for d in self.drafters if catch[d] <= 0}
        looking = look_first(
            catch, self._state(seq).looks, self.free, cost.verify_s(batch, 1), batch, s.look_steps, s.look_share
        )
        return Outlook(
            {d: self.estimate(seq, d) for d in self.drafters},
            lag,
            catch,
            {d: steps_to_read(n, chunk) for d, n in lag.items()},
            ready_seconds(cost, batch, whole, self.lengths),
            looking,
            self._remaining(seq),
        )

    # -- the policy protocol ----------------------------------------------------------------------
    def plan(self, seqs: list, batch_size: int) -> StepPlan:
        """Each sequence's drafter and length (:meth:`route` then names the drafter), and the backlogs
        drafters must read first (``Plan.reads``: the engine has the drafter side read them; nothing is
        read here). Free drafters are asked what they would propose (a lookup, no model: scored by
        :meth:`observe`)."""
        s = self.settings
        chunk = read_chunk(batch_size, self.catch_up_tokens if self.parts is not None else None, self.max_k)
        outlooks = [self._outlook(seq, batch_size, chunk) for seq in seqs]
        if log.isEnabledFor(logging.DEBUG):
            self._trace(seqs, outlooks, batch_size)
        plan = choose(self.cost, batch_size, outlooks, self.drafters, self.lengths, chunk, s)
        rows = plan_rows(plan.choices)
        allowance = exploration_allowance(
            step_seconds(self.cost, batch_size, rows), batch_size, s.explore_cost, s.explore_every
        )
        reading = {d: [seqs[i] for i in rows_of] for d, rows_of in plan.reading.items()}
        first = [d for d in self.drafters if d not in self.tried]
        unproven = [] if self.cost.trusted else [d for d in self.drafters if not self.cost.measured(d)]
        out = []
        for seq, o, choice in zip(seqs, outlooks, plan.choices):
            state = self._state(seq)
            state.steps += 1
            due = due_for_exploration(self.drafters, self.tried, state.last_used, state.steps, s.explore_every)
            explore, passed = exploration(
                due,
                o,
                choice,
                plan.lengths,
                rows,
                allowance,
                self.cost,
                batch_size,
                self.lengths,
                self.explore_k,
                s,
                first,
                unproven,
            )
            for d in passed:  # cannot pay, or cannot be afforded, at this load: look again later
                state.last_used[d] = state.steps
            if explore is not None and chunk is not None and o.lag[explore[0]] > chunk:
                if all(r is not seq for r in reading.get(explore[0], [])):  # explored once it has read (stays due)
                    reading.setdefault(explore[0], []).append(seq)
            elif explore is not None:
                rows, choice = moved(rows, choice, explore), explore
            state.choice = choice
            out.append(choice[1])
        self._look(seqs, plan.lengths)
        # (reading is empty unless chunk is set: choose and the exploration above add to it only then)
        return StepPlan(out, tuple(Read(d, tuple(rows_of), cast(int, chunk)) for d, rows_of in reading.items()))

    def _trace(self, seqs: list, outlooks: list[Outlook], batch: int) -> None:
        """Log each pending catch-up decision at DEBUG (what it would cost, what it would save)."""
        for seq, o in zip(seqs, outlooks):
            ok = candidates(o, self.cost, batch, self.lengths, self.settings.catch_up_margin)
            for d in self.drafters:
                if o.catch_up[d] > 0:
                    log.debug(
                        "step %d seq %x %s: lag %d catch-up %.2fs remaining %d ready %.4fs/tok best %.4fs/tok "
                        "(alpha %.2f fill %.2f) others %s -> %s",
                        self._state(seq).steps,
                        id(seq) & 0xFFFF,
                        d,
                        o.lag[d],
                        o.catch_up[d],
                        o.remaining,
                        o.ready,
                        seconds_per_token(self.cost, d, o.known[d], batch, self.lengths),
                        *o.known[d],
                        {
                            x: tuple(round(v, 2) for v in self.estimate(seq, x, whole=True))
                            for x in self.drafters
                            if x != d
                        },
                        "looking first" if o.looking else "pays" if d in ok else "not",
                    )

    def _look(self, seqs: list, lengths: Mapping[str, int]) -> None:
        """Ask each free drafter what it would propose for the sequences it does not draft for at this
        step; :meth:`observe` scores that against what the step emits."""
        for seq in seqs:
            self._state(seq).shadow = {}
        for d in self.free:
            assert self.parts is not None  # self.free is the parts' (empty without parts)
            rows = [seq for seq in seqs if self._state(seq).choice[0] != d]
            if not rows:
                continue
            k = lengths.get(d) or self.explore_k
            for seq, tokens in zip(rows, self.parts.shadow(rows, d, k)):
                self._state(seq).shadow[d] = (k, len(seq.token_ids), list(tokens))

    def num_draft(self, seq, batch_size: int) -> int:
        return self.plan([seq], batch_size).lengths[0]

    def explain(self, batch: int = 1) -> dict:
        """What the plans rest on now, at ``batch``: the costs (and whether their calibration was a quiet
        machine's) and, per drafter, its acceptance over all sequences so far and the speed it would give
        a sequence against plain decoding at its best length (drafting needs ``1 + margin``)."""
        cost, plain = self.cost, self.cost.verify_s(batch, 1)
        drafters = {}
        for d in self.drafters:
            h = self.history[d]
            est = estimate(Counts(), h, self.settings.prior_weight)
            per_token = {
                k: (cost.verify_s(batch, k + 1) + cost.draft_s(d, 1, k)) / expected_tokens(*est, k)
                for k in self.lengths
            }
            best = min(per_token, key=per_token.__getitem__)
            drafters[d] = {
                "tried": d in self.tried,
                "alpha": round(est[0], 4),
                "fill": round(est[1], 4),
                "tokens_judged": round(h.accepted + h.rejected, 1),
                "draft_token_s": cost.draft_s(d, 1, 1),
                "best_k": best,
                "speed_vs_plain": round(plain / per_token[best], 4),
            }
        return {
            "calibration": "quiet" if cost.trusted else "busy",
            "noise": cost.noise.describe(),
            "step_s": plain,
            "verify_s": {w: cost.verify_s(batch, w) for w in (2, 5, 9)},
            "margin": self.settings.margin,
            "drafters": drafters,
        }

    def route(self, seq) -> str | None:
        """The drafter chosen for ``seq`` at the last plan (None: it does not draft)."""
        state = self._seqs.get(id(seq))
        return state.choice[0] if state is not None and state.choice[1] > 0 else None

    def label(self, seq, k: int) -> str | None:
        drafter = self.route(seq)
        return f"{drafter}:k{k}" if drafter is not None and k > 0 else "off"

    def record(
        self, seq, drafter: str, requested: int, drafted: int, accepted: int, compared: int | None = None
    ) -> None:
        """Count one step of ``drafter`` on ``seq``: asked for ``requested`` tokens, it proposed
        ``drafted`` and ``accepted`` were accepted (``compared``: see :meth:`Counts.add`)."""
        state, s = self._state(seq), self.settings
        state.counts[drafter] = state.counts.get(drafter, Counts()).add(requested, drafted, accepted, s.decay, compared)
        state.whole[drafter] = state.whole.get(drafter, Counts()).add(requested, drafted, accepted, 1.0, compared)
        state.looks[drafter] = state.looks.get(drafter, 0) + 1
        self.history[drafter] = self.history[drafter].add(requested, drafted, accepted, s.prior_decay, compared)
        self.tried.add(drafter)
        state.last_used[drafter] = state.steps  # it is learnt about: no need to explore it

    def observe(self, seq, drafted: int, accepted: int) -> None:
        state = self._seqs.get(id(seq))
        if state is None:
            return
        for d, (k, pos, tokens) in state.shadow.items():
            matched, compared = shadow_score(tokens, seq.token_ids[pos:])
            self.record(seq, d, k, len(tokens), matched, compared)
        state.shadow = {}
        drafter, requested = state.choice
        if drafter is not None and requested > 0:
            self.record(seq, drafter, requested, drafted, accepted)
            state.choice = (None, 0)

    def observe_step(self, batch_size: int, width: int, draft_s: float, verify_s: float) -> None:
        self.cost.record("verify", batch_size, width, verify_s)

    def idle(self, seqs: list) -> None:
        """A step in which nothing may draft (a verify budget at its cap): no plan, no reads, and no
        choice left over for :meth:`observe` to count."""
        for seq in seqs:
            state = self._state(seq)
            state.steps += 1
            state.choice, state.shadow = (None, 0), {}

    def forget(self, seq) -> None:
        self._seqs.pop(id(seq), None)


def auto_drafting(
    parts: dict[str, "Drafter"],
    cost: CostModel,
    *,
    max_k: int,
    catch_up_tokens: int | None = CATCH_UP_TOKENS,
    settings: SelectorSettings = SelectorSettings(),
) -> tuple["MultiDrafter", AutoPolicy]:
    """The multi-drafter over ``parts`` and the selector that routes it, built complete: the parts
    (with their late-start bookkeeping) first, then the selector that asks them, then the
    multi-drafter that drafts with the selector's routes. Measured proposal and catch-up times go to
    ``cost``, which the selector plans with."""
    from specdecode.drafters.multi import MultiDrafter, Parts

    lineup = Parts(parts, on_catch_up=cost.record_catch_up)
    selector = AutoPolicy(list(parts), cost, lineup, max_k=max_k, catch_up_tokens=catch_up_tokens, settings=settings)
    return MultiDrafter(lineup, selector.route, on_timing=cost.record), selector
