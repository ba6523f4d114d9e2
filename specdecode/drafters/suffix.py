"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024, as in Snowflake's Arctic Inference): propose
the most frequent continuation of the longest suffix of the sequence that occurred before, in the
sequence itself (prompt + output) or in the outputs of earlier requests.

**The index.** A suffix tree capped at depth ``D`` answers one question: for the string ``s`` made
of the last ``L <= D`` tokens, where did ``s`` occur before, and which tokens followed it how often
(a node's children and their counts)? :class:`SuffixIndex` answers it from positions instead of
nodes, which in Python is smaller and cheaper to grow: the text as a token list and, for each level
``n`` in 1, 2, 4, ... up to ``D`` (and ``D``), a map from the ``n`` tokens ending at position ``p``
(the token itself at level 1, the hash of the tuple above) to the positions ``p``, ascending (a
lone position as a bare int: most long n-grams occur once, and an int is smaller than a list and
not tracked by the garbage collector). Appending a token adds one position per level: O(log D)
dictionary appends (each hashing at most ``D`` tokens in C), never a rebuild: about 4 us a token,
15 ms for a 4k-token prompt, 0.7 kB a token at depth 64 (a node-per-suffix trie of depth 64 would
create up to 64 nodes per token). Removing tokens at the end (a rollback) pops the same positions,
O(log D) per token.

**Matching** (:meth:`SuffixIndex.matches`): from the highest level down, the first level ``n`` whose
key of the last ``n`` tokens has earlier occurrences (verified against the text: a hash proves
nothing) bounds the match to ``[n, next level)``; each occurrence is extended to its exact length
by binary search over slice comparisons. The longest length ``L`` and its occurrences ``P`` (the
latest ``MAX_OCCURRENCES`` of them, with a token after them) are the matched node; the shorter
indexed lengths (with more occurrences each) come next, on demand.

**Proposing** (:func:`walk`, :func:`grow_tree`): the children of a node are the tokens at ``p + 1``
for ``p`` in ``P``, counted; the drafter takes the most frequent (ties: the latest occurrence), its
*confidence* is the product along the path of each chosen child's share among its siblings (the
empirical probability that the text goes that way), and the node moves to the occurrences that took
it. A chain stops when the confidence would fall below ``min_prob`` (0.1) or at
``min(k, floor(factor * L))`` tokens (``factor`` 1.0): the longer the match, the longer the draft it
may buy (Arctic Inference's ``max_spec_factor`` / ``min_token_prob`` rule). A draft's *score* is the
sum of its tokens' confidences (the expected number accepted under the counts). Like Arctic
Inference, which scores every match length, the drafter keeps the best-scoring draft over the
longest match and the shorter indexed lengths, trying them longest first and stopping once a
length's cap cannot beat the best score (a draft scores at most its cap): usually the longest match
alone, but in a run such as ``x x x x`` the longest match ends one token before the end and can
offer only that token, while ``x x`` occurs all along with ``x`` after it. With ``tree_topk > 1`` the
same counts grow a tree best-first by confidence: each expanded node gets its ``tree_topk`` most
frequent children that stay above ``min_prob``, to ``tree_nodes`` nodes and that depth (a tree's
score, the sum over its nodes, is also at most its depth cap: siblings' confidences sum to at most
their parent's).

**Two indexes.** Each running sequence has its own index over its prompt and the tokens generated
so far, kept in step at every proposal (the drafter reads ``seq.token_ids``, appends what is new and
rolls back to the common prefix if the sequence changed behind it). One global :class:`History`
holds the *outputs* of finished sequences (added at ``release``): outputs only, because the prompt
of a running sequence is already in its own index, and a prompt (a RAG document, an 8k-character
code context) would push out dozens of outputs from a bounded history while carrying the user's
text rather than what the model writes. The history is bounded by ``history`` tokens (default
32,768, about 23 MB of index) and evicts whole requests, first in first out; 0 turns it off. Each proposal matches both
indexes and keeps the draft with the larger score (ties: the sequence's own), as Arctic Inference
does.

**Exactness.** Proposals are deterministic: point masses (``Proposal.probs is None``) that the
verifier accepts with probability ``p_target(token)``, and tree siblings verified by the
DETERMINISTIC rule (c). Which tokens are proposed (any text, any history) only changes speed, never
the output law; the counts and confidences are heuristics of length, not probabilities the
verifier uses. The drafter needs no model (``free = True``), so ``--draft-policy auto`` may ask it
for any sequence at any step (:meth:`specdecode.drafters.multi.Parts.shadow`).

``--draft suffix`` or ``suffix:depth=64,history=32768,prob=0.1,factor=1.0`` (any subset).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from specdecode.drafters.base import DrafterBase, Proposal, SequenceView
from specdecode.verify.tree import DETERMINISTIC

SEP = -1  # ends each request in the history: no n-gram and no continuation crosses it
MAX_OCCURRENCES = 256  # a node's counts come from its latest occurrences at most (bounds a proposal's cost)


def levels_for(depth: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``depth``, then ``depth``: the n-gram lengths indexed."""
    out, n = [], 1
    while n < depth:
        out.append(n)
        n *= 2
    return tuple(out + [depth])


def _key(tokens: list[int], end: int, n: int):
    """Key of the ``n`` tokens ending before ``end``: the token itself at n = 1, else a hash."""
    return tokens[end - 1] if n == 1 else hash(tuple(tokens[end - n : end]))


class SuffixIndex:
    """A token text (one sequence, or several separated by :data:`SEP`) and, per level ``n``, the end
    positions of every ``n``-gram in it, ascending. Positions below ``base`` are dead (evicted)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"the suffix depth must be >= 1, got {depth}")
        self.depth = depth
        self.levels = levels_for(depth)
        self.maps: list[dict] = [{} for _ in self.levels]
        self.tokens: list[int] = []
        self.begin = 0  # first position of the sequence being appended (n-grams start at or after it)
        self.base = 0  # first live position

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append ``new`` (O(levels) per token)."""
        text, maps, levels = self.tokens, self.maps, self.levels
        for tok in new:
            text.append(tok)
            end = len(text)
            room = end - self.begin
            for n, index in zip(levels, maps):
                if n > room:
                    break
                key = tok if n == 1 else hash(tuple(text[end - n : end]))
                found = index.get(key)
                if found is None:
                    index[key] = end - 1
                elif type(found) is int:
                    index[key] = [found, end - 1]
                else:
                    found.append(end - 1)

    def end_sequence(self) -> None:
        """Close the sequence being appended: nothing after it matches into it."""
        self.tokens.append(SEP)
        self.begin = len(self.tokens)

    def truncate(self, length: int) -> None:
        """Forget the tokens from ``length`` on (the sequence being appended only)."""
        text = self.tokens
        if length < self.begin:
            raise ValueError("cannot truncate into a closed sequence")
        for end in range(len(text), length, -1):
            for n, index in zip(self.levels, self.maps):
                if n > end - self.begin:
                    break
                key = _key(text, end, n)
                found = index[key]  # its latest position is end - 1
                if type(found) is int:
                    del index[key]
                elif len(found) == 2:
                    index[key] = found[0]
                else:
                    found.pop()
        del text[length:]

    def match(self, ctx: list[int]) -> tuple[int, list[int]]:
        """The longest ``L <= depth`` such that ``ctx[-L:]`` ends at earlier live positions followed by a
        token, and those positions (the latest :data:`MAX_OCCURRENCES`, ascending); ``(0, [])`` if none.
        ``ctx`` may be this index's own text: its last position has no token after it, so it never
        matches itself."""
        return next(self.matches(ctx), (0, []))

    def matches(self, ctx: list[int]) -> Iterator[tuple[int, list[int]]]:
        """:meth:`match`, then each shorter indexed length ``n`` (1, 2, 4, ...) with its occurrences,
        longest first; lazily."""
        longest = True
        for li in range(len(self.levels) - 1, -1, -1):
            n = self.levels[li]
            cands = self._occurrences(li, ctx) if n <= len(ctx) else []
            if not cands:
                continue
            if longest:
                longest = False
                upper = min(self.levels[li + 1] - 1 if li + 1 < len(self.levels) else n, len(ctx))
                if upper > n:
                    lengths = [_extend(self.tokens, ctx, p, n, min(upper, p + 1 - self.base)) for p in cands]
                    best = max(lengths)
                    if best > n:
                        yield best, [p for p, m in zip(cands, lengths) if m == best][-MAX_OCCURRENCES:]
            yield n, cands[-MAX_OCCURRENCES:]

    def _occurrences(self, li: int, ctx: list[int]) -> list[int]:
        """Live end positions of ``ctx``'s last ``levels[li]`` tokens that a token follows (ascending)."""
        n, text, stop = self.levels[li], self.tokens, len(self.tokens) - 1  # a match ends before the last position
        found = self.maps[li].get(_key(ctx, len(ctx), n))
        if found is None:
            return []
        tail = ctx[-n:]
        return [
            p
            for p in ((found,) if type(found) is int else found[-MAX_OCCURRENCES - 1 :])
            if p < stop
            and p - n + 1 >= self.base
            and text[p + 1] != SEP
            and (n == 1 or text[p - n + 1 : p + 1] == tail)
        ]


def _extend(text: list[int], ctx: list[int], p: int, lo: int, hi: int) -> int:
    """The longest ``m`` in ``[lo, hi]`` with ``text[p - m + 1 : p + 1] == ctx[-m:]``, given that ``lo`` matches."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text[p - mid + 1 : p + 1] == ctx[-mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def children(text: list[int], positions: list[int]) -> list[tuple[int, list[int]]]:
    """The tokens that follow ``positions`` (ascending) and where: ``(token, [p + 1, ...])``, most
    frequent first, ties to the latest occurrence."""
    groups: dict[int, list[int]] = {}
    n = len(text)
    for p in positions:
        q = p + 1
        if q < n:
            tok = text[q]
            if tok != SEP:
                at = groups.get(tok)
                if at is None:
                    groups[tok] = [q]
                else:
                    at.append(q)
    return sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][-1]), reverse=True)


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]  # -1: the pending token; a chain's are i - 1
    confidence: list[float]  # per token: the product of the chosen children's shares along its path

    @property
    def score(self) -> float:
        return sum(self.confidence)


EMPTY = Draft([], [], [])


def walk(text: list[int], positions: list[int], max_len: int, min_prob: float) -> Draft:
    """The chain of most frequent children from the node at ``positions``, while its confidence stays
    at or above ``min_prob``, at most ``max_len`` tokens."""
    out: list[int] = []
    path: list[float] = []
    conf = 1.0
    while len(out) < max_len and positions:
        if len(positions) == 1:  # one occurrence: its continuation, at the same confidence
            q = positions[0] + 1
            run = text[q : q + max_len - len(out)]
            if SEP in run:
                run = run[: run.index(SEP)]
            out += run
            path += [conf] * len(run)
            break
        kids = children(text, positions)
        if not kids:
            break
        total = sum(len(at) for _, at in kids)
        tok, at = kids[0]
        if conf * len(at) / total < min_prob:
            break
        conf *= len(at) / total
        out.append(tok)
        path.append(conf)
        positions = at
    return Draft(out, list(range(-1, len(out) - 1)), path)


def grow_tree(
    text: list[int], positions: list[int], max_depth: int, max_nodes: int, topk: int, min_prob: float
) -> Draft:
    """A tree of the likeliest continuations: nodes taken best-first by confidence, each node's
    ``topk`` most frequent children above ``min_prob``, at most ``max_nodes`` nodes and ``max_depth``
    deep. Parents come before their children."""
    draft = Draft([], [], [])
    heap: list = []
    order = 0  # breaks confidence ties in the order children were found (most frequent first)

    def expand(node: int, positions: list[int], conf: float, depth: int) -> None:
        nonlocal order
        if depth >= max_depth:
            return
        kids = children(text, positions)
        total = sum(len(at) for _, at in kids)
        for tok, at in kids[:topk]:
            c = conf * len(at) / total
            if c < min_prob:
                break  # the rest are rarer
            heapq.heappush(heap, (-c, order, tok, at, node, depth + 1))
            order += 1

    expand(-1, positions, 1.0, 0)
    while heap and len(draft.tokens) < max_nodes:
        neg, _, tok, at, parent, depth = heapq.heappop(heap)
        node = len(draft.tokens)
        draft.tokens.append(tok)
        draft.parents.append(parent)
        draft.confidence.append(-neg)
        expand(node, at, -neg, depth)
    return draft


class History:
    """The outputs of finished requests in one index, at most ``budget`` tokens, evicted whole
    requests first in first out (a longer output keeps its last ``budget`` tokens). Evicted
    positions are skipped at lookup and compacted away once they are half the text."""

    def __init__(self, depth: int, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"the history budget must be >= 0 tokens, got {budget}")
        self.depth, self.budget = depth, budget
        self.index = SuffixIndex(depth)
        self.requests: deque[tuple[int, int]] = deque()  # (start, end) of each live request's tokens
        self.live = 0  # tokens of the live requests

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.budget :] if self.budget else []
        if not tokens:
            return
        while self.requests and self.live + len(tokens) > self.budget:
            start, end = self.requests.popleft()
            self.live -= end - start
            self.index.base = self.requests[0][0] if self.requests else len(self.index)
        if self.index.base > len(self.index) // 2:
            self._compact()
        start = len(self.index)
        self.index.extend(tokens)
        self.index.end_sequence()
        self.requests.append((start, start + len(tokens)))
        self.live += len(tokens)

    def _compact(self) -> None:
        old, spans = self.index.tokens, list(self.requests)
        self.index = SuffixIndex(self.depth)
        self.requests.clear()
        for start, end in spans:
            self.requests.append((len(self.index), len(self.index) + end - start))
            self.index.extend(old[start:end])
            self.index.end_sequence()

    def outputs(self) -> list[list[int]]:
        """The live requests' tokens, oldest first."""
        return [self.index.tokens[s:e] for s, e in self.requests]


@dataclass
class _Slot:
    index: SuffixIndex  # prompt + generated so far
    prompt_len: int  # where the output starts (what the history gets at release)
    live: list[int] | None = None  # the sequence's own token list, read once more at release
    max_new: int | None = None  # its params.max_new_tokens (see release)


class SuffixDrafter(DrafterBase):
    """Chains, or with ``tree_topk > 1`` trees of up to ``tree_nodes`` nodes, from the sequence's own
    suffix index and the cross-request history (see the module docstring)."""

    name = "suffix"
    free = True  # a proposal costs no model forward: the selector may ask it for any sequence

    def __init__(
        self,
        depth: int = 64,
        history: int = 32768,
        min_prob: float = 0.1,
        factor: float = 1.0,
        tree_topk: int = 1,
        tree_nodes: int = 0,
    ) -> None:
        if depth < 1 or history < 0 or not 0.0 <= min_prob <= 1.0 or factor <= 0:
            raise ValueError(
                f"need depth >= 1, history >= 0, 0 <= prob <= 1, factor > 0; got depth={depth}, "
                f"history={history}, prob={min_prob}, factor={factor}"
            )
        if tree_topk < 1 or (tree_topk > 1 and tree_nodes < 1):
            raise ValueError(f"need tree_topk >= 1 and, for trees, tree_nodes >= 1; got {tree_topk}, {tree_nodes}")
        self.depth, self.min_prob, self.factor = depth, min_prob, factor
        self.tree_topk, self.tree_nodes = tree_topk, tree_nodes
        self.max_tree_nodes = tree_nodes if tree_topk > 1 else 0
        self.history = History(depth, history)
        self._slots: dict[int, _Slot] = {}

    # -- per-slot state --------------------------------------------------------------------------
    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        for slot, prompt in zip(slots, prompts):
            index = SuffixIndex(self.depth)
            index.extend(prompt)
            self._slots[slot] = _Slot(index, len(prompt))

    def move(self, src: int, dst: int) -> None:
        if src in self._slots:
            self._slots[dst] = self._slots.pop(src)

    def release(self, slot: int) -> None:
        state = self._slots.pop(slot, None)
        if state is None:
            return
        if state.live is not None:  # the tokens accepted at the last step, which no proposal read
            self._sync(state, state.live)
        output = state.index.tokens[state.prompt_len :]
        # An output longer than its max_new_tokens came from no engine: the cost model's calibration
        # grows synthetic sequences that way (specdecode.costmodel.calibrate), and they are no history.
        if state.max_new is None or len(output) <= state.max_new:
            self.history.add(output)

    def forget_outputs(self) -> None:
        self.history = History(self.depth, self.history.budget)

    def remember(self, output: list[int]) -> None:
        self.history.add(output)

    def _state(self, seq: SequenceView) -> _Slot:
        """The slot's index in step with ``seq.token_ids`` (a slot never started begins here, with
        what it has as its prompt)."""
        state = self._slots.get(seq.slot)
        if state is None:
            state = self._slots[seq.slot] = _Slot(SuffixIndex(self.depth), len(seq.token_ids))
        state.live, state.max_new = seq.token_ids, getattr(seq.params, "max_new_tokens", None)
        self._sync(state, seq.token_ids)
        return state

    @staticmethod
    def _sync(state: _Slot, tokens: list[int]) -> None:
        text = state.index.tokens
        n = len(text)
        if n > len(tokens) or tokens[max(0, n - 8) : n] != text[max(0, n - 8) :]:  # changed behind us: roll back
            keep = 0
            while keep < min(n, len(tokens)) and text[keep] == tokens[keep]:
                keep += 1
            state.index.truncate(keep)
            state.prompt_len = min(state.prompt_len, keep)
            n = keep
        if len(tokens) > n:
            state.index.extend(tokens[n:])

    # -- proposing -------------------------------------------------------------------------------
    def draft(self, seq: SequenceView, k: int) -> Draft:
        """The better (by score) of the drafts from the sequence's own index and from the history."""
        if k <= 0:
            return EMPTY
        own = self._state(seq).index
        ctx = own.tokens
        best = EMPTY
        for index in (own, self.history.index) if self.history.requests else (own,):
            for length, positions in index.matches(ctx):
                cap = min(k, int(self.factor * length + 1e-9))
                if cap <= best.score:  # a draft of at most cap tokens scores at most cap: shorter matches can't win
                    break
                if self.tree_topk > 1:
                    d = grow_tree(index.tokens, positions, cap, self.tree_nodes, self.tree_topk, self.min_prob)
                else:
                    d = walk(index.tokens, positions, cap, self.min_prob)
                if d.score > best.score:
                    best = d
        return best

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        drafts = [self.draft(s, k) for s, k in zip(seqs, num_tokens)]
        width = max([len(d.tokens) for d in drafts] + [0])
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        parents = torch.full((len(seqs), width), -1, dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
            parents[b, : len(d.parents)] = torch.tensor(d.parents, dtype=torch.long)
        num = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long)
        if self.tree_topk > 1:
            return Proposal(tokens, None, num, parents, DETERMINISTIC)
        return Proposal(tokens, None, num)


OPTIONS = {"depth": int, "history": int, "prob": float, "factor": float}


def parse(arg: str) -> dict:
    """``depth=64,history=32768,prob=0.1,factor=1.0`` (any subset, any order) -> constructor keywords."""
    from specdecode.drafters import DraftSpecError

    out: dict = {}
    for item in filter(None, (s.strip() for s in arg.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS:
            raise DraftSpecError(
                f"bad suffix drafter spec 'suffix:{arg}': use suffix or suffix:KEY=VALUE,... "
                f"with keys {', '.join(OPTIONS)}"
            )
        try:
            out[{"prob": "min_prob"}.get(key, key)] = OPTIONS[key](value)
        except ValueError:
            raise DraftSpecError(f"bad suffix drafter spec 'suffix:{arg}': {key} must be a number") from None
    try:
        SuffixDrafter(**out)  # the range checks
    except ValueError as exc:
        raise DraftSpecError(f"bad suffix drafter spec 'suffix:{arg}': {exc}") from None
    return out


def validate(arg: str) -> None:
    parse(arg)


def build(arg: str, ctx) -> SuffixDrafter:
    """``--draft suffix`` (depth 64, history 32,768 tokens, min confidence 0.1, factor 1) or
    ``suffix:depth=D,history=N,prob=P,factor=F``."""
    tree = (ctx.config.tree_topk, ctx.config.tree_nodes)
    return SuffixDrafter(**parse(arg), tree_topk=tree[0], tree_nodes=tree[1])
