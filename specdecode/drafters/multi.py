"""Several drafters behind one: each step, each sequence drafts with the part ``route(seq)`` names
(``--draft A --draft B --draft-policy auto``; the selector, :mod:`specdecode.selector`, routes, and
:func:`specdecode.selector.auto_drafting` builds the two together).

Every part sees every sequence (``start``, ``observe``, ``move``, ``release``), so any of them can
take over a sequence at any step: a draft model catches up on the tokens it missed at its next
proposal, as after a rejection. Proposals of the parts are merged into one batch proposal; a part
that proposes point masses (n-gram lookup) gets explicit one-hot distributions when another part in
the same step carries distributions, which the verifier treats exactly as it treats ``probs=None``
(accept with probability ``p_target(x)``, residual ``p_target`` without ``x``). The merged chain is
as wide as its longest proposal, not as the longest request (n-gram lookup often finds nothing).
Chains only: a part that drafts trees is refused. A sequence asked for without a route (a caller
outside the engine's plan, such as ``check``'s verifier-law part) goes to the parts in turn, so each
part's proposals meet the verifier.

**Lazy parts.** A part that says ``lazy_start = True`` (a draft model: its state is a cache of the
tokens it has read, so it can catch up on any history) is not started when a sequence arrives: its
prompt is only remembered (:class:`Parts`), and the part reads it the first time the sequence is
routed to it (then it catches up on the tokens generated meanwhile, as after a rejection). A
sequence the selector never routes to a draft model never costs that model a forward, so under
load, or for a request too short to pay back a long prompt's prefill, choosing among drafters costs
no more than not drafting. :meth:`Parts.lag` tells the selector how many tokens a part would have to
catch up on first, :meth:`Parts.read` lets it have a part read a bounded piece of that backlog at a
step without drafting (a long catch-up spread over several steps: the selector's plan names the reads,
:meth:`MultiDrafter.read_ahead` does them), and ``on_catch_up(name, tokens,
seconds)`` reports what each catch-up cost.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterator, Mapping, Sequence, cast

import torch

from specdecode.drafters.base import Drafter, DrafterBase, FullDrafter, Proposal, SequenceView, TargetFeatures
from specdecode.models.base import Runner
from specdecode.models.device import synchronize


class Parts(Mapping[str, FullDrafter]):
    """A multi-drafter's parts by name, and for each lazy part the sequences it has not started on:
    what the selector asks of the parts (:class:`specdecode.selector.PartsView`) and what the
    multi-drafter drafts with. ``on_catch_up(name, tokens, seconds)`` hears every catch-up: a late
    start, a piece read ahead, a backlog a proposal read through prefill."""

    def __init__(
        self,
        drafters: dict[str, Drafter],
        on_catch_up: Callable[[str, int, float], None] = lambda name, tokens, s: None,
    ) -> None:
        if not drafters:
            raise ValueError("a multi-drafter needs at least one part")
        trees = [name for name, d in drafters.items() if d.max_tree_nodes]
        if trees:
            raise ValueError(f"the selector chooses among chains; {', '.join(trees)} drafts trees")
        # (every part has DrafterBase's defaults for the capabilities it lacks: see FullDrafter)
        self._drafters, self.on_catch_up = cast("dict[str, FullDrafter]", dict(drafters)), on_catch_up
        self.free = tuple(name for name, d in self._drafters.items() if d.free)  # (see shadow)
        # lazy part -> slot -> the prompt it has not read yet (see the module docstring)
        self._waiting: dict[str, dict[int, list[int]]] = {
            name: {} for name, d in self._drafters.items() if d.lazy_start
        }
        self.caught_up_s = 0.0  # seconds of catch-up read inside proposals so far (not drafting time)
        for name in self._waiting:
            self._drafters[name].on_catch_up = functools.partial(self._caught_up, name)

    def __getitem__(self, name: str) -> FullDrafter:
        return self._drafters[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._drafters)

    def __len__(self) -> int:
        return len(self._drafters)

    def _caught_up(self, name: str, tokens: int, seconds: float) -> None:
        self.caught_up_s += seconds
        self.on_catch_up(name, tokens, seconds)

    def waiting(self, name: str) -> list[int]:
        """The slots whose prompt lazy part ``name`` has not started on."""
        return list(self._waiting.get(name, {}))

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        for name, d in self._drafters.items():
            if name in self._waiting:
                self._waiting[name].update((slot, list(p)) for slot, p in zip(slots, prompts))
            else:
                d.start(slots, prompts)

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        done = [d.prefill(slots, pieces, starts) for name, d in self._drafters.items() if name not in self._waiting]
        return any(done)

    def move(self, src: int, dst: int) -> None:
        for name, d in self._drafters.items():
            waiting = self._waiting.get(name)
            if waiting is not None and src in waiting:
                waiting[dst] = waiting.pop(src)
            else:
                d.move(src, dst)

    def release(self, slot: int) -> None:
        for name, d in self._drafters.items():
            waiting = self._waiting.get(name)
            if waiting is not None and slot in waiting:
                del waiting[slot]
            else:
                d.release(slot)

    def forget_outputs(self) -> None:
        for d in self._drafters.values():
            d.forget_outputs()

    def remember(self, output: list[int]) -> None:
        for d in self._drafters.values():
            d.remember(output)

    def lag(self, seq: SequenceView, name: str) -> int:
        """Tokens part ``name`` must read for ``seq`` before it can draft, beyond the one or two a
        proposal always feeds: the whole history when it has not started on ``seq``."""
        waiting = self._waiting.get(name)
        if waiting is not None and seq.slot in waiting:
            return len(seq.token_ids) - 1
        return self._drafters[name].lag(seq)

    def start_late(self, name: str, seqs: Sequence[SequenceView]) -> None:
        """Start lazy part ``name`` on the sequences among ``seqs`` it has not read yet."""
        waiting = self._waiting.get(name)
        late = [s for s in seqs if waiting and s.slot in waiting]
        if not late:
            return
        assert waiting is not None  # (late is empty without it)
        part = self._drafters[name]
        prompts = [waiting[s.slot] for s in late]
        t0 = time.perf_counter()
        part.start([s.slot for s in late], prompts)
        for runner in part.runners().values():
            synchronize(runner)
        for s in late:
            del waiting[s.slot]
        self.on_catch_up(name, sum(len(p) - 1 for p in prompts), time.perf_counter() - t0)

    def read(self, seqs: list[SequenceView], name: str, budget: int) -> int:
        """Part ``name`` reads at most ``budget`` tokens, in all, of the histories of ``seqs`` that it
        lacks (in the order given), without drafting: the selector starts a draft model late in
        pieces, so no step holds the batch for a whole prompt. Returns the tokens read (the part
        reports them through ``on_catch_up``)."""
        waiting = self._waiting.get(name, {})
        for s in seqs:  # it starts on them now, from their first token
            waiting.pop(s.slot, None)
        return self._drafters[name].read(seqs, budget)

    def shadow(self, seqs: list[SequenceView], name: str, k: int) -> list[list[int]]:
        """What free part ``name`` would propose for each of ``seqs`` at length ``k``; nothing is
        drafted or verified (the selector scores it against what the step emits)."""
        if name not in self.free:
            raise ValueError(f"part {name!r} is not free to ask: it runs a model")
        p = self._drafters[name].propose(seqs, [k] * len(seqs))
        return [p.tokens[b, : int(p.num_tokens[b])].tolist() for b in range(len(seqs))]


class MultiDrafter(DrafterBase):
    """Drafts each sequence with the part ``route(seq)`` names; ``on_timing(name, rows, k, seconds)``
    hears each part's proposal time, catch-up excluded. ``parts`` may be a plain dict (name ->
    drafter) where nobody needs to hear catch-ups."""

    def __init__(
        self,
        parts: Parts | dict[str, Drafter],
        route: Callable[[SequenceView], str | None],
        on_timing: Callable[[str, int, int, float], None] = lambda name, rows, k, s: None,
    ) -> None:
        self.parts = parts if isinstance(parts, Parts) else Parts(parts)
        self.route, self.on_timing = route, on_timing
        self._turn = 0  # for callers outside the engine's plan (see propose)
        self.name = "+".join(self.parts)
        self.feature_layers = tuple(sorted({layer for d in self.parts.values() for layer in d.feature_layers}))

    def reserve(self, num_slots: int, max_len: int) -> None:
        for d in self.parts.values():
            d.reserve(num_slots, max_len)

    def keep_prefixes(self, budget: Callable[[Runner], int]) -> None:  # each part that keeps them restores itself
        for d in self.parts.values():
            d.keep_prefixes(budget)

    def kept_bytes(self) -> int:
        return sum(d.kept_bytes() for d in self.parts.values())

    def runners(self) -> dict[str, Runner]:
        out: dict[str, Runner] = {}
        for name, d in self.parts.items():
            for role, runner in d.runners().items():
                out[role if role not in out else f"{role}[{name}]"] = runner
        return out

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        self.parts.start(slots, prompts)

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        return self.parts.prefill(slots, pieces, starts)

    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        for d in self.parts.values():
            if d.feature_layers:
                d.observe(
                    slots,
                    [
                        TargetFeatures(f.start, f.token_ids, {layer: f.hidden[layer] for layer in d.feature_layers})
                        for f in features
                    ],
                )

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        bsz = len(seqs)
        rows_of: dict[str, list[int]] = {}
        names = list(self.parts)
        for b, (s, k) in enumerate(zip(seqs, num_tokens)):
            if k <= 0:
                continue
            name = self.route(s)
            if name is None:  # asked without a plan (``check``'s law part): the parts take turns
                name, self._turn = names[self._turn % len(names)], self._turn + 1
            rows_of.setdefault(name, []).append(b)
        parts: list[tuple[list[int], Proposal]] = []
        for name, rows in rows_of.items():
            ks = [num_tokens[b] for b in rows]
            self.parts.start_late(name, [seqs[b] for b in rows])
            caught_up = self.parts.caught_up_s
            t0 = time.perf_counter()
            parts.append((rows, self.parts[name].propose([seqs[b] for b in rows], ks)))
            # (a backlog read through prefill inside the proposal is catch-up, reported apart)
            self.on_timing(name, len(rows), max(ks), time.perf_counter() - t0 - (self.parts.caught_up_s - caught_up))
        return merge(bsz, parts)

    def read_ahead(self, reads) -> None:
        """A plan's catch-up reads (:class:`specdecode.policy.Read`, the selector's): each names a part and
        the sequences whose backlogs it reads, at most ``budget`` tokens in all, without drafting."""
        for r in reads:
            self.parts.read(list(r.seqs), r.part, r.budget)

    def move(self, src: int, dst: int) -> None:
        self.parts.move(src, dst)

    def release(self, slot: int) -> None:
        self.parts.release(slot)

    def forget_outputs(self) -> None:
        self.parts.forget_outputs()

    def remember(self, output: list[int]) -> None:
        self.parts.remember(output)


def merge(batch: int, parts: list[tuple[list[int], Proposal]]) -> Proposal:
    """One chain proposal for ``batch`` rows from the parts' proposals for their rows."""
    width = max([int(p.num_tokens.max()) for _, p in parts if p.num_tokens.numel()] + [0])
    tokens = torch.zeros(batch, width, dtype=torch.long)
    num = torch.zeros(batch, dtype=torch.long)
    vocab = max([p.probs.shape[-1] for _, p in parts if p.probs is not None] + [0])
    probs = None
    if vocab:
        dtype = next(p.probs.dtype for _, p in parts if p.probs is not None)
        device = next(p.probs.device for _, p in parts if p.probs is not None)
        probs = torch.zeros(batch, width, vocab, dtype=dtype, device=device)
    for rows, p in parts:
        n = p.num_tokens.clamp(max=width)
        for i, b in enumerate(rows):
            m = int(n[i])
            if m == 0:
                continue
            tokens[b, :m] = p.tokens[i, :m].cpu()
            num[b] = m
            if probs is None:
                continue
            if p.probs is None:  # a point mass: the distribution a deterministic draft was "sampled" from
                probs[b, torch.arange(m, device=probs.device), tokens[b, :m].to(probs.device)] = 1.0
            else:
                probs[b, :m, : p.probs.shape[-1]] = p.probs[i, :m].to(probs.device, probs.dtype)
    return Proposal(tokens, probs, num)
