"""Several drafters behind one: each step, each sequence drafts with the part ``route(seq)`` names
(``--draft A --draft B --draft-policy auto``; the selector, :mod:`specdecode.selector`, routes).

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
prompt is only remembered, and the part prefills it the first time the sequence is routed to it
(then it catches up on the tokens generated meanwhile, as after a rejection). A sequence the
selector never routes to a draft model never costs that model a forward, so under load, or for a
request too short to pay back a long prompt's prefill, choosing among drafters costs no more than
not drafting. :meth:`lag` tells the selector how many tokens a part would have to catch up on first,
:meth:`read` lets it have a part read a bounded piece of that backlog at a step without drafting (a
long catch-up spread over several steps), and ``on_catch_up(name, tokens, seconds)`` reports what a
deferred prefill cost.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from specdecode.drafters.base import Drafter, Proposal, SequenceView, TargetFeatures
from specdecode.models.base import Runner
from specdecode.models.device import synchronize


class MultiDrafter:
    max_tree_nodes = 0

    def __init__(self, parts: dict[str, Drafter], route: Callable[[SequenceView], str | None],
                 on_timing: Callable[[str, int, int, float], None] = lambda name, rows, k, s: None,
                 on_catch_up: Callable[[str, int, float], None] = lambda name, tokens, s: None) -> None:
        if not parts:
            raise ValueError("a multi-drafter needs at least one part")
        trees = [name for name, d in parts.items() if getattr(d, "max_tree_nodes", 0)]
        if trees:
            raise ValueError(f"the selector chooses among chains; {', '.join(trees)} drafts trees")
        self.parts, self.route, self.on_timing, self.on_catch_up = dict(parts), route, on_timing, on_catch_up
        # lazy part -> slot -> the prompt it has not read yet (see the module docstring)
        self._waiting: dict[str, dict[int, list[int]]] = {
            name: {} for name, d in parts.items() if getattr(d, "lazy_start", False)}
        self._caught_up_s = 0.0  # catch-up seconds inside the proposal being timed
        for name in self._waiting:
            parts[name].on_catch_up = lambda tokens, seconds, name=name: self._caught_up(name, tokens, seconds)
        self._turn = 0  # for callers outside the engine's plan (see propose)
        self.name = "+".join(parts)
        self.feature_layers = tuple(sorted({layer for d in parts.values() for layer in d.feature_layers}))

    def reserve(self, num_slots: int, max_len: int) -> None:
        for d in self.parts.values():
            d.reserve(num_slots, max_len)

    def runners(self) -> dict[str, Runner]:
        out: dict[str, Runner] = {}
        for name, d in self.parts.items():
            for role, runner in d.runners().items():
                out[role if role not in out else f"{role}[{name}]"] = runner
        return out

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        for name, d in self.parts.items():
            if name in self._waiting:
                self._waiting[name].update((slot, list(p)) for slot, p in zip(slots, prompts))
            else:
                d.start(slots, prompts)

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        done = [d.prefill(slots, pieces, starts) for name, d in self.parts.items()
                if hasattr(d, "prefill") and name not in self._waiting]
        return any(done)

    def lag(self, seq: SequenceView, name: str) -> int:
        """Tokens part ``name`` must read for ``seq`` before it can draft, beyond the one or two a
        proposal always feeds: the whole history when it has not started on ``seq``."""
        waiting = self._waiting.get(name)
        if waiting is not None and seq.slot in waiting:
            return len(seq.token_ids) - 1
        lag = getattr(self.parts[name], "lag", None)
        return lag(seq) if lag is not None else 0

    def _start_late(self, name: str, seqs: list[SequenceView]) -> None:
        """Start lazy part ``name`` on the sequences among ``seqs`` it has not read yet."""
        waiting = self._waiting.get(name)
        late = [s for s in seqs if waiting and s.slot in waiting]
        if not late:
            return
        part = self.parts[name]
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
        pieces, so no step holds the batch for a whole prompt. A lazy part that cannot read in pieces
        starts on them whole now. Returns the tokens read (also reported through ``on_catch_up``)."""
        part, waiting = self.parts[name], self._waiting.get(name, {})
        if not hasattr(part, "read"):
            tokens = sum(len(waiting[s.slot]) - 1 for s in seqs if s.slot in waiting)
            self._start_late(name, list(seqs))
            return tokens
        for s in seqs:  # it starts on them now, from their first token
            waiting.pop(s.slot, None)
        return part.read(seqs, budget)

    def free_parts(self) -> tuple[str, ...]:
        """Parts whose proposals cost no model forward (n-gram lookup): :meth:`shadow` may ask them."""
        return tuple(name for name, d in self.parts.items() if getattr(d, "free", False))

    def shadow(self, seqs: list[SequenceView], name: str, k: int) -> list[list[int]]:
        """What free part ``name`` would propose for each of ``seqs`` at length ``k``; nothing is
        drafted or verified (the selector scores it against what the step emits)."""
        if name not in self.free_parts():
            raise ValueError(f"part {name!r} is not free to ask: it runs a model")
        p = self.parts[name].propose(seqs, [k] * len(seqs))
        return [p.tokens[b, : int(p.num_tokens[b])].tolist() for b in range(len(seqs))]

    def _caught_up(self, name: str, tokens: int, seconds: float) -> None:
        self._caught_up_s += seconds
        self.on_catch_up(name, tokens, seconds)

    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        for d in self.parts.values():
            if d.feature_layers:
                d.observe(slots, [TargetFeatures(f.start, f.token_ids, {layer: f.hidden[layer] for layer in d.feature_layers})
                                  for f in features])

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
            self._start_late(name, [seqs[b] for b in rows])
            self._caught_up_s = 0.0
            t0 = time.perf_counter()
            parts.append((rows, self.parts[name].propose([seqs[b] for b in rows], ks)))
            # (a backlog read through prefill inside the proposal is catch-up, reported apart)
            self.on_timing(name, len(rows), max(ks), time.perf_counter() - t0 - self._caught_up_s)
        return merge(bsz, parts)

    def move(self, src: int, dst: int) -> None:
        for name, d in self.parts.items():
            waiting = self._waiting.get(name)
            if waiting is not None and src in waiting:
                waiting[dst] = waiting.pop(src)
            else:
                d.move(src, dst)

    def release(self, slot: int) -> None:
        for name, d in self.parts.items():
            waiting = self._waiting.get(name)
            if waiting is not None and slot in waiting:
                del waiting[slot]
            else:
                d.release(slot)


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
