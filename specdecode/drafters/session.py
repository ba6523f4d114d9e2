"""A drafter's lifecycle over an engine's sequences: when it starts on each, what it is owed until then, and
when it lets go. The engine calls these verbs and never asks whether the drafter has started, caught up or
prefilled a sequence (llama.cpp's drafter surface is init / propose / accept / free; this is that, with the
engine's chunked prefill and late start):

* :meth:`DraftSession.prompts_cached`: the target has cached these prompts. The drafter starts on them now,
  unless a sequence's first token comes from the target alone (``after_first_token``, the server and
  ``generate``): then it starts at the sequence's second step (:meth:`catch_up`), so speculation never delays
  the first token.
* :meth:`DraftSession.cached`: the target cached these tokens (its hidden states of the layers the drafter
  named): a started drafter observes them; one not started yet keeps them and reads them at its start.
* :meth:`DraftSession.catch_up`: before a step, start the drafter on running sequences it owes a start; with
  chunked prefill (``prefill_chunk``) it first caches a long prompt a chunk per sequence and step (the
  sequence decodes target-only meanwhile).
* :meth:`DraftSession.ready`: the sequences it may draft for at this step; :meth:`DraftSession.read_ahead`:
  the backlogs a plan (:class:`specdecode.policy.Plan`) asks a late drafter to read before it proposes;
  :meth:`DraftSession.propose`.
* :meth:`DraftSession.move` / :meth:`DraftSession.release`: a sequence changed slot, or finished.

A request that opts out of speculation (``SamplingParams.speculation = False``) never reaches the drafter: it
is never started on, and nothing is kept for it. The per-sequence record is ``Sequence.draft``
(:class:`specdecode.drafters.state.DraftState`), read and written here alone. With ``isolate_faults`` (the
server) the drafter is wrapped in :class:`specdecode.drafters.guard.GuardedDrafter`: a drafter exception
makes the rows involved decode target-only instead of failing the step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, cast

from specdecode.drafters.base import Drafter, FullDrafter, Proposal, TargetFeatures
from specdecode.models.base import Runner

if TYPE_CHECKING:
    from specdecode.drafters.guard import GuardedDrafter


class ReadsAhead(Protocol):
    """A drafter whose plans name catch-up reads (a multi-drafter, or a guard around one)."""

    def read_ahead(self, reads: Sequence) -> None: ...


class DraftSession:
    """The drafter's side of an engine (``drafter`` None: target-only, every verb does nothing)."""

    def __init__(
        self,
        drafter: Drafter | None,
        *,
        after_first_token: bool = False,
        prefill_chunk: int | None = None,
        isolate_faults: bool = False,
    ) -> None:
        self._guard: GuardedDrafter | None = None
        # (a drafter derives from DrafterBase: it has every capability, its own or the default; see FullDrafter)
        full = cast("FullDrafter | None", drafter)
        self._raw = full  # (outside its fault guard: the prefix cache is the drafter's own bookkeeping)
        if full is not None and isolate_faults:
            from specdecode.drafters.guard import GuardedDrafter

            full = self._guard = GuardedDrafter(full)
        self.drafter = full
        self.feature_layers: tuple[int, ...] = tuple(full.feature_layers) if full is not None else ()
        self.max_tree_nodes = full.max_tree_nodes if full is not None else 0
        self.after_first_token = after_first_token
        self.prefill_chunk = prefill_chunk  # prompt tokens per sequence and step (None: whole prompts)

    def keep_prefixes(self, budget: Callable[[Runner], int]) -> None:
        """The drafter keeps its models' KV of finished sequences, each runner's share of the one budget."""
        if self._raw is not None:  # (outside its fault guard: the prefix cache is the drafter's own bookkeeping)
            self._raw.keep_prefixes(budget)

    def kept_bytes(self) -> int:
        """Memory the drafter's kept prefixes hold (0 without a drafter, or one that keeps none)."""
        return self._raw.kept_bytes() if self._raw is not None else 0

    # -- the target cached tokens ---------------------------------------------------------------------
    def prompts_cached(self, seqs: Sequence) -> None:
        """The target has cached the prompts of ``seqs`` (all but each one's pending token)."""
        if self.drafter is not None and not self.after_first_token:
            self._start([s for s in seqs if s.params.speculation])

    def cached(self, seqs: Sequence, features: Sequence[TargetFeatures]) -> None:
        """The target cached the tokens ``features[i]`` covers for ``seqs[i]`` (only called with the layers
        the drafter asked for): observed at once where the drafter has started, else kept for its start;
        nothing is kept for a request that does not speculate (it decodes target-only to the end)."""
        if not self.feature_layers:
            return
        live = [(s, f) for s, f in zip(seqs, features) if s.draft.started]
        if live:
            assert self.drafter is not None  # (feature_layers are empty without a drafter)
            self.drafter.observe([s.slot for s, _ in live], [f for _, f in live])
        for s, f in zip(seqs, features):
            if s.draft.started or not s.draft.eligible:
                continue
            if s.params.speculation:
                s.draft.early_features.append(f)
            else:
                s.draft.early_features, s.draft.eligible = [], False

    # -- before a step ----------------------------------------------------------------------------------
    def catch_up(self, running: Sequence) -> None:
        """Start the drafter on the running sequences it owes a start: after their first token when that
        comes from the target alone; with chunked prefill, once it has cached their prompt a chunk a step.
        A request that does not speculate never costs the drafter anything."""
        if self.drafter is None:
            return
        late = [
            s
            for s in running
            if not s.draft.started
            and s.draft.eligible
            and s.params.speculation
            and (s.output_ids or not self.after_first_token)
        ]
        if late and self.prefill_chunk is not None:
            late = self._prefill(late)  # a chunk; those whose prompt it has cached start now
        if late:
            self._start(late)

    def ready(self, seqs: Sequence) -> list[bool]:
        """Whether the drafter may draft for each of ``seqs`` at this step (it has read the prompt)."""
        return [s.draft.started for s in seqs]

    def read_ahead(self, reads: Sequence) -> None:
        """The catch-up reads a plan asks for (:class:`specdecode.policy.Read`), before anything is proposed:
        a drafter that chooses among parts reads each part's backlog without drafting."""
        if reads:  # (only a multi-drafter's plans have reads)
            cast(ReadsAhead, self.drafter).read_ahead(reads)

    def propose(self, seqs: Sequence, num_tokens: list[int]) -> Proposal:
        """Up to ``num_tokens[b]`` tokens for each row (trimmed: a drafter that found fewer than it was asked
        for must not have its padding verified)."""
        if self.drafter is None or not any(num_tokens):
            return Proposal.empty(len(seqs))
        return self.drafter.propose(seqs, num_tokens).trimmed()

    # -- slots --------------------------------------------------------------------------------------------
    def move(self, seq, dst: int) -> None:
        """``seq`` moves from its slot to ``dst`` (the engine keeps running slots contiguous)."""
        if self._holds(seq):
            assert self.drafter is not None  # (see _holds)
            self.drafter.move(seq.slot, dst)

    def release(self, seq) -> None:
        """``seq`` has finished (or was aborted): the drafter lets its slot go."""
        if self._holds(seq):
            assert self.drafter is not None  # (see _holds)
            self.drafter.release(seq.slot)

    def _holds(self, seq) -> bool:
        return self.drafter is not None and (seq.draft.started or seq.draft.prefilled > 0)

    def slots_used(self, running: Sequence) -> int:
        """Slots the drafter holds state for (after a drafter fault, fewer than the started ones)."""
        if self._guard is not None:
            return len(self._guard.live)
        return sum(s.draft.started for s in running) if self.drafter is not None else 0

    @property
    def faults(self) -> tuple[int, int]:
        """(drafter failures, rows retried alone) absorbed so far (``isolate_faults``; else (0, 0))."""
        return (self._guard.failures, self._guard.retries) if self._guard is not None else (0, 0)

    def runners(self) -> dict[str, Runner]:
        """The model runners the drafter owns, by role (the ``runners`` capability)."""
        return self.drafter.runners() if self.drafter is not None else {}

    def forget_outputs(self) -> None:
        """The drafter drops what it keeps of finished requests' outputs (the ``history`` capability)."""
        if self.drafter is not None:
            self.drafter.forget_outputs()

    def remember(self, output: list[int]) -> None:
        """The drafter keeps ``output`` as a finished request's (the ``history`` capability)."""
        if self.drafter is not None:
            self.drafter.remember(output)

    # -- what a drafter start and a chunked prefill do ---------------------------------------------------
    def _prefill(self, seqs: list) -> list:
        """The drafter's prompt prefill in chunks too (a draft model's): at most ``prefill_chunk`` prompt
        tokens per sequence and step; returns the sequences whose prompt the drafter has cached (all of them
        when it does nothing in pieces). The others keep decoding target-only until then. The chunk is per
        sequence, not shared, so when a request starts drafting never depends on the rest of the batch (nor,
        then, do its seeded samples)."""
        assert self.drafter is not None and self._raw is not None  # (catch_up calls it only with a drafter)
        for s in seqs:  # a prompt's first chunk starts after the longest prefix the drafter kept
            if not s.draft.looked_up:  # (once, before its first chunk)
                s.draft.looked_up = True
                s.draft.prefilled = self._raw.restore(s.slot, s.prompt_ids)
        work = [(s, min(len(s.prompt_ids) - 1 - s.draft.prefilled, self.prefill_chunk)) for s in seqs]
        work = [(s, n) for s, n in work if n > 0]
        if work:
            t0 = time.perf_counter()
            if not self.drafter.prefill(
                [s.slot for s, _ in work],
                [s.prompt_ids[s.draft.prefilled : s.draft.prefilled + n] for s, n in work],
                [s.draft.prefilled for s, _ in work],
            ):
                return seqs
            elapsed = time.perf_counter() - t0
            for s, n in work:
                s.draft.prefilled += n
                s.stats.prefill_s += elapsed
        return [s for s in seqs if s.draft.prefilled >= len(s.prompt_ids) - 1]

    def _start(self, seqs: list) -> None:
        """The drafter's start on ``seqs``: the prompt, then the target features kept since admission, in
        order (the drafter catches up on tokens generated meanwhile at its next proposal)."""
        if not seqs:
            return
        assert self.drafter is not None  # (its callers return first without a drafter)
        t0 = time.perf_counter()
        self.drafter.start([s.slot for s in seqs], [s.prompt_ids for s in seqs])
        for j in range(max(len(s.draft.early_features) for s in seqs)):
            rows = [s for s in seqs if j < len(s.draft.early_features)]
            self.drafter.observe([s.slot for s in rows], [s.draft.early_features[j] for s in rows])
        elapsed = time.perf_counter() - t0
        for s in seqs:
            s.draft.started, s.draft.early_features = True, []
            s.stats.prefill_s += elapsed
