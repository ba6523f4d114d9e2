"""The drafter protocol: every proposer (draft model, n-gram lookup, Medusa, EAGLE) implements it.

A drafter only *proposes*; exactness comes from verification, which needs the distribution each
draft token was sampled from (``Proposal.probs``), or ``None`` when proposals are deterministic.
A proposal is a chain, or a tree when ``Proposal.parents`` is given (see :mod:`specdecode.tree`).

Drafters keep their own per-slot state (e.g. a KV cache). At the next ``propose`` they compare
what they consumed with the sequence's tokens and roll back to the common prefix, so state stays in
step whatever happened in between (partial acceptance, full acceptance with a bonus token, a stop
cut). A drafter that wants the target's hidden states names the layers in ``feature_layers``; the
engine then calls ``observe`` with the features of every token the target has cached: the
prompt's after prefill, and after each step the pending token's and the accepted drafts'. A
drafter with ``feature_layers = ()`` is never called and the target computes nothing extra.

Each drafter lives in one file with a ``build(arg, ctx)`` factory, listed in
:mod:`specdecode.drafters` (the registry).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from specdecode.models.base import Features, Runner
from specdecode.sampling import SamplingParams


class SequenceView(Protocol):
    """What a drafter may read of a running sequence."""

    slot: int
    token_ids: list[int]  # prompt + generated so far; the last token is not yet in any cache
    params: SamplingParams
    generator: torch.Generator


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, K] long, padded past each row's num_tokens
    probs: torch.Tensor | None  # [B, K, V] warped draft distributions; None = point masses
    num_tokens: torch.Tensor  # [B] long, how many tokens row b proposes (<= requested)
    parents: torch.Tensor | None = None  # [B, K] long tree parents (-1 = the pending token); None = chains
    rule: str | None = None  # trees: how siblings were drawn (specdecode.verify.tree.RULES); None = i.i.d.

    @staticmethod
    def empty(batch: int) -> "Proposal":
        return Proposal(torch.zeros(batch, 0, dtype=torch.long), None, torch.zeros(batch, dtype=torch.long))

    def trimmed(self) -> "Proposal":
        """A chain proposal cut to its longest row: a drafter that found fewer tokens than it was asked for
        (a lookup without a match) would otherwise have the target verify its padding, and on a CPU each
        verified position costs about as much as a drafted one. Trees are returned as they are."""
        if self.parents is not None:
            return self
        width = int(self.num_tokens.max()) if self.num_tokens.numel() else 0  # (chain lengths: host tensors)
        if width >= self.tokens.shape[1]:
            return self
        return dataclasses.replace(
            self, tokens=self.tokens[:, :width], probs=None if self.probs is None else self.probs[:, :width]
        )


@dataclass
class TargetFeatures:
    """The target's hidden states for tokens it has just cached for one sequence."""

    start: int  # position of the first token covered
    token_ids: list[int]  # the tokens covered (positions start .. start + n - 1)
    hidden: Features  # feature layer -> [n, H] on the target's device


class Drafter(Protocol):
    """What the engine calls (through :class:`specdecode.drafters.session.DraftSession`, which owns when each
    call happens). Everything else a drafter may offer is an optional capability (:data:`CAPABILITIES`),
    declared on its registry entry (:class:`specdecode.drafters.DrafterKind`) and defaulted in
    :class:`DrafterBase`."""

    name: str
    feature_layers: tuple[int, ...]  # target feature layers it wants (see models.base); () = none
    max_tree_nodes: int  # the largest tree it proposes (0: chains only)

    def reserve(self, num_slots: int, max_len: int) -> None:
        """Size per-slot state (the engine calls this once, from its batch size and context)."""

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        """New sequences occupy ``slots``; ``prompts[i]`` is the prompt of ``slots[i]``."""

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        """Ahead of ``start`` (the engine's chunked prefill): cache the prompt tokens ``pieces[i]`` at
        positions ``starts[i]..`` of the new sequence in ``slots[i]`` (``0``: its first piece), so ``start``
        later has only the rest to do. False: nothing is done in pieces (then ``start`` takes whole
        prompts); :class:`DrafterBase` says False."""

    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        """Target features of newly cached tokens (only called when ``feature_layers`` is non-empty)."""

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        """Propose up to ``num_tokens[b]`` tokens continuing each sequence."""

    def move(self, src: int, dst: int) -> None:
        """The sequence in slot ``src`` now lives in slot ``dst``."""

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` has finished."""


class CatchesUp(Protocol):
    """Capability ``catch_up``: its state is the tokens it has read (a draft model), so it may start on a
    sequence late and catch up (:mod:`specdecode.drafters.multi` starts it only when the selector first routes
    a sequence to it; :mod:`specdecode.costmodel` times its catch-up)."""

    lazy_start: bool  # True
    # told of each backlog a proposal first read through prefill (tokens, seconds): catch-up, not drafting
    on_catch_up: Callable[[int, float], None]

    def lag(self, seq: SequenceView) -> int:
        """Tokens the next proposal for ``seq`` must read beyond the usual one or two."""

    def read(self, seqs: Sequence[SequenceView], budget: int) -> int:
        """Read up to ``budget`` tokens, in all, of what ``seqs`` have that the drafter has not read,
        without drafting (a slot it has never seen has read nothing: a lazy drafter starts this way).
        Returns the tokens read."""


class OwnsRunners(Protocol):
    """Capability ``runners``: it runs models of its own (reports, memory, where each model runs)."""

    def runners(self) -> dict[str, Runner]:
        """The model runners it owns, by role (e.g. ``{"draft": runner}``)."""


class KeepsHistory(Protocol):
    """Capability ``history``: it drafts from earlier requests' outputs (suffix decoding), which a benchmark
    must control."""

    def forget_outputs(self) -> None:
        """Drop what it keeps of finished requests' outputs, so the next request drafts as if none had run:
        a benchmark's repeat must not draft from its own earlier output."""

    def remember(self, output: list[int]) -> None:
        """Keep ``output`` as the output of a finished request, as ``release`` would have kept it: a resumed
        benchmark replays the runs it skips, so what follows drafts as in an unbroken run."""


class KeepsPrefixes(Protocol):
    """Capability ``prefixes``: it keeps its own model's KV of finished sequences and starts a new prompt after
    the longest prefix it kept (:class:`specdecode.prefix_cache.RunnerPrefixCache`), as the target does."""

    def keep_prefixes(self, budget: Callable[[Runner], int]) -> None:
        """Keep finished sequences' KV, up to ``budget(runner)`` bytes for each of its runners that keeps them
        (the engine calls this once; :class:`specdecode.prefix_cache.BudgetSplit`)."""

    def restore(self, slot: int, tokens: list[int]) -> int:
        """Before a new sequence's first prefill in ``slot``: restore the longest kept prefix of ``tokens`` (all
        but the last token at most); returns its length (0: nothing kept, nothing done)."""

    def kept_bytes(self) -> int:
        """Memory its kept prefixes hold now (the server's ``/metrics``)."""


class FullDrafter(Drafter, CatchesUp, OwnsRunners, KeepsHistory, KeepsPrefixes, Protocol):
    """A drafter with every optional capability, each its own or :class:`DrafterBase`'s default: what
    :class:`specdecode.drafters.session.DraftSession` and a multi-drafter's parts are called with (a drafter
    the engine gets derives from :class:`DrafterBase`)."""

    free: bool  # (free)


# optional capabilities, by the name a registry entry declares (``DrafterKind.capabilities``)
CAPABILITIES: dict[str, str] = {
    "catch_up": "starts late and catches up on what it has not read (CatchesUp: lazy_start, lag, read, on_catch_up)",
    "free": "a proposal costs no model forward (free = True): the selector asks it what it would propose anywhere",
    "runners": "owns model runners (OwnsRunners: runners)",
    "history": "drafts from earlier requests' outputs (KeepsHistory: forget_outputs, remember)",
    "prefixes": "keeps its model's KV of finished sequences for the next prompt (KeepsPrefixes: keep_prefixes, restore, kept_bytes)",
}


def capabilities(drafter: object) -> frozenset[str]:
    """The optional capabilities ``drafter`` has (what its class adds to :class:`DrafterBase`'s defaults)."""
    found = set()
    if getattr(drafter, "lazy_start", False):
        found.add("catch_up")
    if getattr(drafter, "free", False):
        found.add("free")
    for name, member in (("runners", "runners"), ("history", "remember"), ("prefixes", "restore")):
        if getattr(type(drafter), member, None) not in (None, getattr(DrafterBase, member)):
            found.add(name)
    return frozenset(found)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` items agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DrafterBase:
    """Defaults for the parts of the protocol a drafter may leave out (no features, chains, nothing done in
    pieces, no per-slot state) and for every optional capability (always in step, each proposal costing a
    forward, no runners, no history): a drafter that has a capability overrides its default."""

    name = "drafter"
    feature_layers: tuple[int, ...] = ()
    max_tree_nodes = 0  # the largest tree it proposes (0: chains only); the engine sizes its window by it
    lazy_start = False  # (catch_up)
    free = False  # (free)
    on_catch_up: Callable[[int, float], None] = staticmethod(lambda tokens, seconds: None)  # (catch_up)

    def reserve(self, num_slots: int, max_len: int) -> None:
        pass

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        pass

    def keep_prefixes(self, budget: Callable[[Runner], int]) -> None:  # (prefixes)
        pass

    def restore(self, slot: int, tokens: list[int]) -> int:  # (prefixes)
        return 0

    def kept_bytes(self) -> int:  # (prefixes)
        return 0

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        return False

    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    # -- optional capabilities' defaults ------------------------------------------------------------------
    def lag(self, seq: SequenceView) -> int:  # (catch_up)
        return 0

    def read(self, seqs: Sequence[SequenceView], budget: int) -> int:  # (catch_up)
        return 0

    def runners(self) -> dict[str, Runner]:  # (runners)
        return {}

    def forget_outputs(self) -> None:  # (history)
        pass

    def remember(self, output: list[int]) -> None:  # (history)
        pass
