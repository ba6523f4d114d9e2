"""``--draft-policy auto``: before each step, choose for every sequence which drafter drafts for it and
how many tokens (or none), maximising the whole batch's expected tokens per second.

Three parts:

* **Cost** (:mod:`specdecode.costmodel`): seconds of the target's verify step ``v(batch, width)`` and
  of each drafter's proposal ``draft(d, rows, k)``, measured at engine start and corrected online
  from every step's measured times.
* **Acceptance**, per sequence and drafter: a per-token acceptance rate ``alpha`` and a *fill* rate
  (the share of the requested tokens the drafter actually proposed: n-gram lookup often finds
  nothing). Each is a ratio of discounted counts (each step's observation counts 1, older ones decay
  by ``decay`` per observation, so the estimate follows drift), with a prior from the drafter's
  history over all sequences (itself discounted more slowly) worth ``prior_weight`` (10) accepted or
  rejected tokens: about three steps of the sequence's own. Why that much: a sequence's last few
  steps predict its next one barely better than the drafter's recent history does. Replaying every
  step of the fixed draft-model and lookup runs of two benchmarks (both samplings, seven categories;
  ``scripts/acceptance_prior.py``, ``docs/benchmarks.md`` session 20), the next step's accepted
  count is likelier under a prior worth 10 than under one worth 3 in 27 of the 28 (drafter,
  sampling, category) cells and in a shuffled, mixed order (decay 0.7 either way); with a prior
  worth 3 the chosen length chased streaks (on HumanEval at T = 0.7, 6- and 8-token drafts).
  A step a drafter drafted for updates it. A *free* drafter (no model: n-gram lookup) is also asked,
  every step, what it would have proposed for the sequences it did not draft for, and that shadow
  proposal is scored against the tokens the step emitted (matched prefix = accepted; an unbiased
  acceptance observation, greedy or sampled, since a point-mass draft token is accepted with the
  same probability p_target(token) with which the emitted token equals it); so n-gram is tracked on
  every sequence at no cost and never needs exploring. With chains, a step that drafted ``n`` tokens and
  accepted ``a`` adds ``a`` acceptances and, when ``a < n``, one rejection; expected tokens of a
  chain of ``k`` are ``1 + fill * (alpha + alpha^2 + ... + alpha^k)``.
* **Choice**: the step time of a plan is ``v(B, 1 + max k) + sum_d draft(d, rows_d, k_d)`` (rows
  are padded to the widest chain), its yield the sum of the sequences' expected tokens; each
  sequence goes to the drafter that promises it most at that drafter's length. Coordinate ascent
  over one length per drafter (``0`` = not used) from "nothing drafts", two rounds; drafting is
  chosen only when it beats plain decoding by ``margin``. As the batch grows, ``v(B, width)`` stops
  being nearly free and the chosen lengths shrink to zero on their own.

**Catching up.** A draft model reads the sequence's tokens itself, and it starts late (see
:mod:`specdecode.drafters.multi`): the first time it drafts for a sequence it must first read the
prompt and what was generated since, and after other drafters drafted for a while, what they
produced. That one-off cost (``lag`` tokens at the cost model's ``catch_up`` seconds per token) is
paid only if the drafter is expected to save the sequence twice as much time over its remaining
tokens (at most ``horizon`` of them) as the catch-up costs the batch, which waits for it:
``remaining * (ready - best seconds per token with it) > (1 + catch_up_margin) * B * catch-up
seconds``, where ``ready`` is the best the sequence gets without any catch-up (plain decoding
``v(B, 1)``, or a drafter already in step, such as n-gram lookup on a summary that copies its
article); otherwise the drafter is not a candidate for that sequence at this step. So a long prompt
with a short answer never pays a draft model's prefill it cannot earn back, and under load, where no
drafter pays, requests cost what they cost without speculation. Why twice (``catch_up_margin`` =
1): the catch-up is a measured cost, paid once and for good; the saving is a forecast from other
requests' history (the draft model has not drafted for this one yet), taken at the best of several
lengths. On three real RAG requests the forecast was 0.13–0.14 s a token and the draft model then
did 0.07–0.19 (docs/benchmarks.md, session 18): an error as large as the saving it is weighed
against, so a catch-up must promise twice its cost. ``ready`` is judged over the whole
request so far (undiscounted counts plus the prior), not the discounted estimate that picks each
step's drafter: one unlucky step of lookup must not buy a catch-up for the rest of the request.
And a catch-up costing ``n`` plain steps waits until every free drafter has been scored on
``min(look_steps, look_share * n)`` of the sequence's steps (3 and a quarter by default): a reply's
opening says little about whether lookup will match later (on a RAG answer it missed its first two
steps, then matched 4 of 4 on nine), and waiting costs at most a quarter of the catch-up. Short
catch-ups (a HumanEval or QA prompt: a step or three) do not wait. When other sequences share the step
(batch > 1), a backlog longer than ``catch_up_tokens`` (at least ``max_k + 2``) is not read inside
one step, which would hold every running stream for the whole prompt: the drafter reads
``catch_up_tokens`` tokens per step, shared by the sequences it reads for in batch order (the
multi-drafter's ``read``), while they take the best plan without it, and it drafts once what is
left fits one piece. The pay-back rule counts those steps as tokens the drafter no longer saves
(``remaining - ceil(lag / (catch_up_tokens - 1))``). Alone, a sequence reads its backlog at once: no
other running sequence waits, and it drafts sooner.

**Exploration.** A drafter not used for a sequence learns nothing about it, so every
``explore_every`` steps of a sequence (and at the first chance, for a drafter that has never drafted
or been scored at all: its prior is a guess, and against a free drafter's equal guess it would
otherwise wait for its turn), a drafter it has not used for that long drafts for it once
(at that step's length for the drafter, or ``explore_k``), unless the cost model says that drafter
could not pay even if it were always right (then it is never tried: exploring it would only lose),
catch-up included, against what the sequence already has (``ready``: a draft model is not explored
where lookup already matches well enough that even a perfect draft would not earn its catch-up
back), and not while the sequence is still being watched before a catch-up (above). Exploring one row is not free for the others: it may widen the whole batch's
verify and adds a proposal. With ``B`` sequences each exploring about once every ``explore_every``
steps, a step carries ``B / explore_every`` explorations on average, so one is allowed only if what
it adds to the step's planned seconds stays under ``explore_cost * explore_every / B`` of them
(``explore_cost`` = 5 %: exploration costs the batch at most ~5 % of its time). At batch 1 that is
most of a step; at batch 16, where a wider verify costs nearly its full share, exploration stops
unless it rides in a verify already that wide. New sequences start from the drafters' history, so a
drafter that does well on some requests is chosen at once for similar ones.

It only changes which tokens are proposed and how many: verification is exact for any proposal, so
the output law is the target's whatever it decides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from specdecode.costmodel import CostModel

LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
HORIZON = 256  # remaining tokens a catch-up may be paid back over (max_tokens can be the whole context)
CATCH_UP_TOKENS = 64  # tokens of late catch-up per step while other sequences wait for it (None: all at once)
LOOK_STEPS = 3  # steps of a sequence the free drafters are scored on before a dear catch-up (at most)
LOOK_SHARE = 0.25  # ... and at most this share of the catch-up's cost in plain steps
CATCH_UP_MARGIN = 1.0  # a catch-up must be expected to save (1 + this) times what it costs
PRIOR_WEIGHT = 10.0  # the drafter's history counts as this many accepted-or-rejected tokens of a sequence's own
log = logging.getLogger("specdecode.selector")


@dataclass
class _Counts:
    """Discounted evidence about one drafter (for one sequence, or overall)."""

    accepted: float = 0.0
    rejected: float = 0.0
    proposed: float = 0.0
    requested: float = 0.0

    def add(self, requested: int, drafted: int, accepted: int, decay: float, compared: int | None = None) -> None:
        """``compared``: how many of the drafted tokens could be judged (a shadow proposal longer than
        what the step emitted is censored there: no rejection seen); default all of them."""
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + (1 if accepted < (drafted if compared is None else compared) else 0)
        self.proposed = decay * self.proposed + drafted
        self.requested = decay * self.requested + requested


@dataclass
class _SeqState:
    counts: dict[str, _Counts] = field(default_factory=dict)
    whole: dict[str, _Counts] = field(default_factory=dict)  # the same, undiscounted: the request so far
    looks: dict[str, int] = field(default_factory=dict)  # drafter -> steps it was scored on (drafted or shadow)
    last_used: dict[str, int] = field(default_factory=dict)  # drafter -> step index it last drafted
    steps: int = 0
    choice: tuple[str | None, int] = (None, 0)  # this step's (drafter, requested length)
    # free drafters not chosen this step -> (length asked, len(token_ids) at the plan, what they proposed)
    shadow: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


def expected_tokens(alpha: float, fill: float, k: int) -> float:
    """Tokens a step emits for a chain of ``k`` with per-token acceptance ``alpha``."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= alpha
        total += term
    return 1.0 + fill * total


class AutoPolicy:
    """The selector (see the module docstring). ``drafters`` are the names of the parts of the
    engine's :class:`~specdecode.drafters.multi.MultiDrafter`, which asks :meth:`route` which part
    drafts for a sequence. ``cost`` may be set after construction (the engine must exist to measure);
    so may ``lag`` (the multi-drafter's :meth:`~specdecode.drafters.multi.MultiDrafter.lag`: tokens a
    drafter must read before drafting for a sequence; None: never any)."""

    def __init__(self, drafters: list[str], max_k: int, cost: CostModel | None = None,
                 lengths: tuple[int, ...] = LENGTHS, explore_every: int = 16, explore_k: int = 2,
                 decay: float = 0.7, prior_decay: float = 0.98, prior_weight: float = PRIOR_WEIGHT,
                 prior_alpha: float = 0.5, prior_fill: float = 0.8, guess_weight: float = 3.0,
                 margin: float = 0.03,
                 lag: Callable[[object, str], int] | None = None, horizon: int = HORIZON,
                 explore_cost: float = 0.05, catch_up_tokens: int | None = CATCH_UP_TOKENS,
                 read: Callable[[list, str, int], int] | None = None,
                 shadow: Callable[[list, str, int], list[list[int]]] | None = None, free: tuple[str, ...] = (),
                 look_steps: int = LOOK_STEPS, look_share: float = LOOK_SHARE,
                 catch_up_margin: float = CATCH_UP_MARGIN) -> None:
        if not drafters:
            raise ValueError("the selector needs at least one drafter")
        if max_k < 1:
            raise ValueError(f"max draft length must be >= 1, got {max_k}")
        self.drafters, self.max_k, self.cost = list(drafters), max_k, cost
        self.lengths = sorted({k for k in lengths if k <= max_k} | {max_k})
        self.explore_every, self.explore_k = explore_every, min(explore_k, max_k)
        if explore_cost < 0:
            raise ValueError(f"explore_cost must be >= 0, got {explore_cost}")
        self.explore_cost = explore_cost
        self.decay, self.prior_decay, self.prior_weight, self.margin = decay, prior_decay, prior_weight, margin
        self.lag, self.horizon = lag, horizon
        if catch_up_tokens is not None and catch_up_tokens < 1:
            raise ValueError(f"catch_up_tokens must be >= 1 (or None: whole), got {catch_up_tokens}")
        self.catch_up_tokens, self.read = catch_up_tokens, read
        self.shadow, self.free = shadow, tuple(free)
        if look_steps < 0 or look_share < 0:
            raise ValueError(f"look_steps and look_share must be >= 0, got {look_steps}, {look_share}")
        self.look_steps, self.look_share = look_steps, look_share
        if catch_up_margin < 0:
            raise ValueError(f"catch_up_margin must be >= 0, got {catch_up_margin}")
        self.catch_up_margin = catch_up_margin
        # before any observation a drafter's history is a guess (prior_alpha, prior_fill) worth only
        # guess_weight tokens: the first real observations outweigh it
        self.history = {d: _Counts(prior_alpha * guess_weight, (1 - prior_alpha) * guess_weight,
                                   prior_fill * guess_weight, guess_weight) for d in self.drafters}
        self._seqs: dict[int, _SeqState] = {}
        self.tried: set[str] = set()  # drafters with at least one real observation (drafted, or shadow-scored)

    # -- estimates ----------------------------------------------------------------------------------
    def estimate(self, seq, drafter: str, whole: bool = False) -> tuple[float, float]:
        """(alpha, fill) for ``seq`` and ``drafter``: its own discounted counts plus the prior; with
        ``whole``, its counts over the whole request so far (undiscounted) plus the prior."""
        h = self.history[drafter]
        state = self._state(seq)
        own = (state.whole if whole else state.counts).get(drafter, _Counts())
        w = self.prior_weight
        prior_alpha = h.accepted / max(h.accepted + h.rejected, 1e-9)
        prior_fill = h.proposed / max(h.requested, 1e-9)
        alpha = (own.accepted + w * prior_alpha) / (own.accepted + own.rejected + w)
        fill = (own.proposed + w * prior_fill) / (own.requested + w)
        return min(alpha, 0.999), min(fill, 1.0)

    def _state(self, seq) -> _SeqState:
        return self._seqs.setdefault(id(seq), _SeqState())

    # -- the policy protocol ----------------------------------------------------------------------
    def plan(self, seqs: list, batch_size: int) -> list[int]:
        if self.cost is None:
            raise RuntimeError("the selector has no cost model yet (see specdecode.costmodel)")
        chunk = self._chunk(batch_size)
        lags = [{d: self.lag(s, d) if self.lag is not None else 0 for d in self.drafters} for s in seqs]
        catch = [{d: self.cost.catch_up_s(d, n) if n > 0 else 0.0 for d, n in lag.items()} for lag in lags]
        known = [{d: self.estimate(s, d) for d in self.drafters} for s in seqs]
        # what each sequence can do without any catch-up (plain decoding, or a drafter already in step),
        # judged over the whole request so far: a catch-up is a decision for the rest of the request
        ready = [min([self.cost.verify_s(batch_size, 1)] + [self._per_token(d, self.estimate(s, d, whole=True),
                                                                            batch_size)
                                                            for d in self.drafters if c[d] <= 0])
                 for s, c in zip(seqs, catch)]
        looking = [self._looking(s, c, batch_size) for s, c in zip(seqs, catch)]
        est = [{d: e[d] for d in self.drafters
                if (c[d] <= 0 or not look) and
                self._pays_back(s, d, e[d], batch_size, c[d], self._steps_to_read(lag[d], chunk), r)}
               for s, e, c, lag, r, look in zip(seqs, known, catch, lags, ready, looking)]
        if log.isEnabledFor(logging.DEBUG):
            self._trace(seqs, known, catch, lags, ready, looking, est, batch_size)
        lengths = self._best_lengths(est, batch_size)
        choices = [self._assign(e, lengths) for e in est]
        reading: dict[str, list] = {}  # drafter -> sequences it reads ahead for at this step (batch order)
        if chunk is not None and any(d is not None and lag[d] > chunk for (d, _), lag in zip(choices, lags)):
            # a drafter far behind reads in pieces first; meanwhile the sequence takes the best plan without it
            for i, (s, (d, _)) in enumerate(zip(seqs, choices)):
                if d is not None and lags[i][d] > chunk:
                    reading.setdefault(d, []).append(s)
                    est[i] = {x: e for x, e in est[i].items() if lags[i][x] <= chunk}
            lengths = self._best_lengths(est, batch_size)
            choices = [self._assign(e, lengths) for e in est]
        step = _Step(self.cost, batch_size, choices)
        allowance = self.explore_cost * self.explore_every * step.seconds() / max(1, batch_size)
        out = []
        for i, (s, choice, c) in enumerate(zip(seqs, choices, catch)):
            state = self._state(s)
            state.steps += 1
            delay = {d: self._steps_to_read(n, chunk) for d, n in lags[i].items()}
            explore = self._explore(s, state, choice, lengths, batch_size, c, step, allowance, delay,
                                    ready[i], looking[i])
            if explore is not None and chunk is not None and lags[i][explore[0]] > chunk:
                if all(r is not s for r in reading.get(explore[0], [])):  # explored once it has read (stays due)
                    reading.setdefault(explore[0], []).append(s)
            elif explore is not None:
                step.move(choice, explore)
                choice = explore
            state.choice = choice
            out.append(choice[1])
        for d, rows in reading.items():
            self.read(rows, d, chunk)
        self._look(seqs, lengths)
        return out

    def _trace(self, seqs, known, catch, lags, ready, looking, est, batch) -> None:
        """Log each pending catch-up decision at DEBUG (what it would cost, what it would save)."""
        for s, e, c, lag, r, look, ok in zip(seqs, known, catch, lags, ready, looking, est):
            for d in self.drafters:
                if c[d] > 0:
                    log.debug("step %d seq %x %s: lag %d catch-up %.2fs remaining %d ready %.4fs/tok best %.4fs/tok "
                              "(alpha %.2f fill %.2f) others %s -> %s", self._state(s).steps, id(s) & 0xffff, d,
                              lag[d], c[d], self._remaining(s), r, self._per_token(d, e[d], batch), *e[d],
                              {x: tuple(round(v, 2) for v in self.estimate(s, x, whole=True))
                               for x in self.drafters if x != d},
                              "looking first" if look else "pays" if d in ok else "not")

    def _looking(self, seq, catch: dict[str, float], batch: int) -> bool:
        """Should ``seq`` watch the free drafters a little longer before any catch-up? A catch-up
        costing ``n`` plain steps of the batch waits until every free drafter has been scored on
        ``min(look_steps, look_share * n)`` of the sequence's steps: its first steps (a reply's
        opening) say little about whether lookup will match later, and a catch-up is paid once, for
        the rest of the request. Waiting costs at most those steps' gain, a ``look_share`` of the
        catch-up; with no free drafter there is nothing to learn by waiting."""
        dearest = max(catch.values(), default=0.0)
        if dearest <= 0 or self.shadow is None or not self.free:
            return False
        steps = dearest * max(1, batch) / max(self.cost.verify_s(batch, 1), 1e-9)
        need = min(self.look_steps, int(self.look_share * steps))
        looks = self._state(seq).looks
        return any(looks.get(d, 0) < need for d in self.free)

    def _look(self, seqs: list, lengths: dict[str, int]) -> None:
        """Ask each free drafter (no model: n-gram lookup) what it would propose for the sequences it
        does not draft for at this step; :meth:`observe` scores that against what the step emits."""
        for s in seqs:
            self._state(s).shadow = {}
        if self.shadow is None:
            return
        for d in self.free:
            rows = [s for s in seqs if self._state(s).choice[0] != d]
            if not rows:
                continue
            k = lengths.get(d) or self.explore_k
            for s, tokens in zip(rows, self.shadow(rows, d, k)):
                self._state(s).shadow[d] = (k, len(s.token_ids), list(tokens))

    def num_draft(self, seq, batch_size: int) -> int:
        return self.plan([seq], batch_size)[0]

    def route(self, seq) -> str | None:
        """The drafter chosen for ``seq`` at the last plan (None: it does not draft)."""
        state = self._seqs.get(id(seq))
        return state.choice[0] if state is not None and state.choice[1] > 0 else None

    def label(self, seq, k: int) -> str | None:
        drafter = self.route(seq)
        return f"{drafter}:k{k}" if drafter is not None and k > 0 else "off"

    def observe(self, seq, drafted: int, accepted: int) -> None:
        state = self._seqs.get(id(seq))
        if state is None:
            return
        self._observe_shadow(seq, state)
        if state.choice[0] is None or state.choice[1] <= 0:
            return
        drafter, requested = state.choice
        state.counts.setdefault(drafter, _Counts()).add(requested, drafted, accepted, self.decay)
        state.whole.setdefault(drafter, _Counts()).add(requested, drafted, accepted, 1.0)
        state.looks[drafter] = state.looks.get(drafter, 0) + 1
        self.history[drafter].add(requested, drafted, accepted, self.prior_decay)
        self.tried.add(drafter)
        state.last_used[drafter] = state.steps
        state.choice = (None, 0)

    def _observe_shadow(self, seq, state: _SeqState) -> None:
        """Score the free drafters' shadow proposals against the tokens the step emitted. A point-mass
        draft token is accepted with probability p_target(token), and the emitted token equals it with
        that same probability (the output follows the target's law), position by position while they
        agree: so the matched prefix is an unbiased acceptance observation, greedy or sampled, without
        drafting. Past what the step emitted nothing is judged (no rejection counted)."""
        for d, (k, pos, tokens) in state.shadow.items():
            emitted = list(seq.token_ids[pos:])
            compared = min(len(tokens), len(emitted))
            matched = next((i for i in range(compared) if tokens[i] != emitted[i]), compared)
            state.counts.setdefault(d, _Counts()).add(k, len(tokens), matched, self.decay, compared)
            state.whole.setdefault(d, _Counts()).add(k, len(tokens), matched, 1.0, compared)
            state.looks[d] = state.looks.get(d, 0) + 1
            self.history[d].add(k, len(tokens), matched, self.prior_decay, compared)
            self.tried.add(d)
            state.last_used[d] = state.steps  # it is learnt about: no need to explore it
        state.shadow = {}

    def observe_step(self, batch_size: int, width: int, draft_s: float, verify_s: float) -> None:
        if self.cost is not None:
            self.cost.record("verify", batch_size, width, verify_s)

    def observe_draft(self, drafter: str, rows: int, k: int, seconds: float) -> None:
        """One part's proposal time (the multi-drafter reports it)."""
        if self.cost is not None:
            self.cost.record(drafter, rows, k, seconds)

    def observe_catch_up(self, drafter: str, tokens: int, seconds: float) -> None:
        """A late start's measured catch-up (the multi-drafter reports it)."""
        if self.cost is not None:
            self.cost.record_catch_up(drafter, tokens, seconds)

    def forget(self, seq) -> None:
        self._seqs.pop(id(seq), None)

    # -- the choice ----------------------------------------------------------------------------------
    def _chunk(self, batch_size: int) -> int | None:
        """Backlog tokens read per step beside other sequences (None: whole, at once). At least
        ``max_k + 2``: more than a step can add to a backlog, so reading always gets ahead."""
        if batch_size <= 1 or self.read is None or self.catch_up_tokens is None:
            return None
        return max(self.catch_up_tokens, self.max_k + 2)

    @staticmethod
    def _steps_to_read(lag: int, chunk: int | None) -> int:
        """About how many steps a sequence decodes without a drafter while it reads a backlog of
        ``lag`` in pieces of ``chunk`` (the sequence itself adds about a token a step meanwhile)."""
        return 0 if chunk is None or lag <= chunk else -(-lag // (chunk - 1))

    def idle(self, seqs: list) -> None:
        """A step in which nothing may draft (a verify budget at its cap): no plan, no reads, and no
        choice left over for :meth:`observe` to count."""
        for s in seqs:
            state = self._state(s)
            state.steps += 1
            state.choice, state.shadow = (None, 0), {}

    def _remaining(self, seq) -> int:
        params, out = getattr(seq, "params", None), getattr(seq, "output_ids", None)
        if params is None or out is None:
            return self.horizon
        return max(0, min(params.max_new_tokens - len(out), self.horizon))

    def _per_token(self, drafter: str, est: tuple[float, float], batch: int) -> float:
        """Seconds per token of one sequence drafting with ``drafter`` at its best length (at ``est``)."""
        return min((self.cost.verify_s(batch, k + 1) + self.cost.draft_s(drafter, 1, k)) / expected_tokens(*est, k)
                   for k in self.lengths)

    def _pays_back(self, seq, drafter: str, est: tuple[float, float], batch: int, catch_up_s: float,
                   delay: int = 0, ready: float | None = None) -> bool:
        """Is ``drafter`` a candidate for ``seq`` at this step: free to start, or expected (at ``est``)
        to save ``seq`` over its remaining tokens (less ``delay``, the steps spent reading in pieces,
        about a token each) ``1 + catch_up_margin`` times what its catch-up costs the batch (the
        catch-up runs inside the steps: every running sequence waits for it)? Saved against
        ``ready``, the seconds per token the sequence gets without any catch-up (plain decoding, or
        a drafter already in step such as n-gram lookup); default plain decoding."""
        if catch_up_s <= 0:
            return True
        ready = self.cost.verify_s(batch, 1) if ready is None else ready
        best = self._per_token(drafter, est, batch)
        return (self._remaining(seq) - delay) * (ready - best) > (1 + self.catch_up_margin) * catch_up_s * max(1, batch)

    def _assign(self, est: dict[str, tuple[float, float]], lengths: dict[str, int]) -> tuple[str | None, int]:
        best, gain = (None, 0), 1.0
        for d, k in lengths.items():
            if k > 0 and d in est:
                e = expected_tokens(*est[d], k)
                if e > gain:
                    best, gain = (d, k), e
        return best

    def _rate(self, est: list[dict], lengths: dict[str, int], batch: int) -> float:
        """Expected tokens per second of a step of ``batch`` sequences (``est`` covers the drafting ones)."""
        choices = [self._assign(e, lengths) for e in est]
        tokens = batch - len(est)  # sequences not planned here emit one token each
        tokens += sum(expected_tokens(*e[d], k) if d is not None else 1.0 for e, (d, k) in zip(est, choices))
        return tokens / max(_Step(self.cost, batch, choices).seconds(), 1e-12)

    def _best_lengths(self, est: list[dict], batch: int) -> dict[str, int]:
        off = {d: 0 for d in self.drafters}
        base = self._rate(est, off, batch)
        best, best_rate = dict(off), base
        for _ in range(2):  # coordinate ascent over one length per drafter
            for d in self.drafters:
                for k in [0, *self.lengths]:
                    trial = {**best, d: k}
                    rate = self._rate(est, trial, batch)
                    if rate > best_rate:
                        best, best_rate = trial, rate
        return best if best_rate > base * (1 + self.margin) else off

    def could_pay(self, drafter: str, batch: int) -> bool:
        """Would ``drafter`` beat plain decoding for a whole batch if it were always right?"""
        plain = batch / self.cost.verify_s(batch, 1)
        for k in self.lengths:
            seconds = self.cost.verify_s(batch, k + 1) + self.cost.draft_s(drafter, batch, k)
            if batch * (k + 1) / seconds > plain * (1 + self.margin):
                return True
        return False

    def _explore(self, seq, state: _SeqState, choice: tuple[str | None, int], lengths: dict[str, int], batch: int,
                 catch_up: dict[str, float], step: "_Step", allowance: float,
                 delay: dict[str, int] | None = None, ready: float | None = None,
                 looking: bool = False) -> tuple[str, int] | None:
        if self.explore_every <= 0:
            return None
        due = [d for d in self.drafters
               if d not in self.tried or state.steps - state.last_used.get(d, 0) >= self.explore_every]
        for d in sorted(due, key=lambda d: state.last_used.get(d, 0)):
            k = lengths[d] or self.explore_k
            if looking and catch_up[d] > 0:
                continue  # still due once the sequence has been watched
            if (self.could_pay(d, batch) and self._pays_back(seq, d, (0.999, 1.0), batch, catch_up[d],
                                                             (delay or {}).get(d, 0), ready)
                    and step.extra(choice, (d, k)) <= allowance):
                return d, k
            state.last_used[d] = state.steps  # cannot pay, or cannot be afforded, at this load: look again later
        return None


class _Step:
    """The planned step's shape (verify width, rows per drafter) and its cost, as explorations join it."""

    def __init__(self, cost: CostModel, batch: int, choices: list[tuple[str | None, int]]) -> None:
        self.cost, self.batch = cost, batch
        self.rows: dict[tuple[str, int], int] = {}
        for choice in choices:
            self._add(choice, 1)

    def _add(self, choice: tuple[str | None, int], n: int) -> None:
        d, k = choice
        if d is not None and k > 0:
            self.rows[(d, k)] = self.rows.get((d, k), 0) + n
            if not self.rows[(d, k)]:
                del self.rows[(d, k)]

    def seconds(self) -> float:
        width = 1 + max((k for _, k in self.rows), default=0)
        return self.cost.verify_s(self.batch, width) + sum(self.cost.draft_s(d, n, k) for (d, k), n in self.rows.items())

    def extra(self, old: tuple[str | None, int], new: tuple[str, int]) -> float:
        """Seconds the step gains when one row goes from ``old`` to ``new``."""
        before = self.seconds()
        self.move(old, new)
        after = self.seconds()
        self.move(new, old)
        return after - before

    def move(self, old: tuple[str | None, int], new: tuple[str | None, int]) -> None:
        self._add(old, -1)
        self._add(new, 1)
