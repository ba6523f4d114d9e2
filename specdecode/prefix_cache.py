"""The longest cached prefix of a prompt: an index of token sequences whose KV a runner saved, with a
memory budget, least-recently-used eviction and pins.

Design (after vLLM's automatic prefix caching and SGLang's radix cache). vLLM hashes fixed-size blocks
of tokens, each hash chained to its parent's, so a lookup walks the prompt block by block; SGLang keeps a
radix tree of token runs. This engine keeps each sequence's KV in one slot of a static cache (not in
pages), so an entry is one whole saved sequence — a runner's opaque saved state (``Runner.export_kv``) —
and the index only has to find which entry shares the longest prefix with a new prompt. Block hashes do
that in one dictionary lookup per block of the prompt (a radix tree would save memory only when entries
share long runs, and costs a node walk per token in Python). The match is then extended token by token
past the last whole block and checked against the entry's own tokens, so a hash collision can never
hand a request another prompt's KV.

An entry whose tokens are a prefix of a new entry's is superseded (a chat's earlier turn, the file an
editor sent a keystroke ago); a pinned entry (being restored) is never evicted. Not thread-safe: the
engine thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator, Sequence
from typing import Any

BLOCK = 16  # tokens per hashed block: a match shorter than one block is not worth a restore


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    value: Any  # what the runner saved (opaque here)
    nbytes: int
    pins: int = 0
    hits: int = 0
    keys: list[int] = field(default_factory=list)  # its chained block hashes, one per whole block


@dataclass
class CacheStats:
    lookups: int = 0
    lookup_tokens: int = 0  # prompt tokens looked up
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens answered from the cache
    inserts: int = 0
    evictions: int = 0
    superseded: int = 0
    refused: int = 0  # entries larger than the whole budget

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PrefixCache:
    """Entries of token sequences within ``budget_bytes``; ``on_evict(entry)`` frees what a runner holds."""

    def __init__(
        self, budget_bytes: int, block: int = BLOCK, on_evict: Callable[[Entry], None] = lambda entry: None
    ) -> None:
        if budget_bytes < 0 or block < 1:
            raise ValueError(f"budget must be >= 0 bytes and block >= 1 token, got {budget_bytes}, {block}")
        self.budget_bytes, self.block, self.on_evict = budget_bytes, block, on_evict
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recently used first
        self.by_key: dict[int, dict[int, Entry]] = {}  # chained block hash -> entries holding that block prefix
        self.nbytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self.entries)

    def _keys(self, tokens: Sequence[int]) -> Iterator[int]:
        key = 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            key = hash((key, *tokens[start : start + self.block]))
            yield key

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that prefix's length (at most ``limit``:
        a prompt's last token must still be fed to get its logits). ``(None, 0)`` below one block."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        candidates: dict[int, Entry] = {}
        for key in self._keys(tokens[:limit]):
            found = self.by_key.get(key)
            if not found:
                break
            candidates = found
        best, length = None, 0
        for entry in reversed(list(candidates.values())):  # the most recently used first on a tie
            n = _common(entry.tokens, tokens, limit)
            if n > length:
                best, length = entry, n
        if best is None or length < self.block:
            return None, 0
        self.entries.move_to_end(id(best))
        best.hits += 1
        self.stats.hits += 1
        self.stats.hit_tokens += length
        return best, length

    def insert(self, tokens: Sequence[int], value: Any, nbytes: int) -> Entry | None:
        """Keep ``value`` (the KV of ``tokens``). Entries whose tokens are a prefix of these are superseded;
        the least recently used unpinned ones are evicted until it fits. None: not kept (shorter than a
        block, larger than the budget, or the budget is held by pinned entries); ``on_evict`` then frees it."""
        tokens = tuple(tokens)
        entry = Entry(tokens, value, nbytes)
        if len(tokens) < self.block or nbytes > self.budget_bytes:
            self.stats.refused += len(tokens) >= self.block
            self.on_evict(entry)
            return None
        pinned = sum(old.nbytes for old in self.entries.values() if old.pins)
        if pinned + nbytes > self.budget_bytes:  # cannot fit without evicting what is in use: evict nothing
            self.on_evict(entry)
            return None
        for old in list(self.entries.values()):
            if old.pins == 0 and len(old.tokens) <= len(tokens) and tokens[: len(old.tokens)] == old.tokens:
                self._drop(old)
                self.stats.superseded += 1
        for old in list(self.entries.values()):
            if self.nbytes + nbytes <= self.budget_bytes:
                break
            if old.pins == 0:
                self._drop(old)
                self.stats.evictions += 1
        entry.keys = list(self._keys(tokens))
        for key in entry.keys:
            self.by_key.setdefault(key, {})[id(entry)] = entry
        self.entries[id(entry)] = entry
        self.nbytes += nbytes
        self.stats.inserts += 1
        return entry

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of ``tokens`` (as it is or as a prefix); marks it used. No stats."""
        tokens = tuple(tokens)
        keys = list(self._keys(tokens))
        candidates = self.by_key.get(keys[-1], {}) if keys else self.entries
        for entry in candidates.values():
            if len(entry.tokens) >= len(tokens) and entry.tokens[: len(tokens)] == tokens:
                self.entries.move_to_end(id(entry))
                return True
        return False

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        if entry.pins < 1:
            raise ValueError("unpin of an entry that is not pinned")
        entry.pins -= 1

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            if entry.pins == 0:
                self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        for key in entry.keys:
            holders = self.by_key.get(key)
            if holders is not None:
                holders.pop(id(entry), None)
                if not holders:
                    del self.by_key[key]
        self.nbytes -= entry.nbytes
        self.on_evict(entry)


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


class RunnerPrefixCache:
    """A :class:`PrefixCache` over one runner: :meth:`restore` the longest saved prefix of a prompt into a
    slot, :meth:`save` what a slot holds. What it keeps is the runner's own ``export_kv`` snapshot, so a
    restored prefix is the KV that runner computed for those very tokens (``import_kv`` then ``truncate``)."""

    def __init__(self, runner, budget_bytes: int, block: int = BLOCK) -> None:
        self.runner = runner
        self.index = PrefixCache(budget_bytes, block)

    @staticmethod
    def supported(runner) -> bool:
        """Whether ``runner`` saves and restores its KV (``export_kv`` / ``import_kv``)."""
        from specdecode.models.base import Runner

        kind = type(runner)
        return kind.export_kv is not Runner.export_kv and kind.import_kv is not Runner.import_kv

    def restore(self, slot: int, tokens: Sequence[int], limit: int) -> int:
        """Restore into ``slot`` the longest saved prefix of ``tokens`` (at most ``limit`` tokens); returns its
        length (0: nothing restored, the slot untouched)."""
        entry, n = self.index.lookup(tokens, limit)
        if entry is None:
            return 0
        self.index.pin(entry)
        try:
            self.runner.import_kv(slot, entry.value)
            self.runner.truncate(slot, n)
        finally:
            self.index.unpin(entry)
        return n

    def save(self, slot: int, tokens: Sequence[int]) -> None:
        """Keep the KV ``slot`` holds for ``tokens`` (its first ``len(tokens)`` positions)."""
        if len(tokens) < self.index.block or self.index.holds(tokens):
            return
        state = self.runner.export_kv(slot, len(tokens))
        self.index.insert(tokens, state, state_nbytes(state))


class BudgetSplit:
    """One budget (``--prefix-cache-mb``) for the target and every draft model that keeps prefixes: a draft
    runner that asks gets a share in proportion to what one position of its KV holds against the target's
    and every draft runner's (:meth:`__call__`); the target takes the rest (:attr:`target`). So the caches
    together never hold more than the budget, and each covers about as many tokens as the others."""

    def __init__(self, total_bytes: int, target, drafts: Sequence = ()) -> None:
        self.total = total_bytes
        self._weight = sum(map(position_bytes, [target, *drafts]))
        self.granted = 0

    def __call__(self, runner) -> int:
        share = int(self.total * position_bytes(runner) / self._weight) if self._weight else 0
        share = min(share, self.total - self.granted)
        self.granted += share
        return share

    @property
    def target(self) -> int:
        return self.total - self.granted


def position_bytes(runner) -> float:
    """What one position of ``runner``'s KV cache holds (its cache over its slots and positions)."""
    positions = runner.num_slots * runner.max_len
    return runner.kv_bytes() / positions if positions else 0.0


def state_nbytes(state: Any) -> int:
    """The memory a runner's KV snapshot holds: its tensors, arrays and byte strings, however nested."""
    if isinstance(state, (bytes, bytearray)):
        return len(state)
    if isinstance(state, memoryview):
        return state.nbytes
    if hasattr(state, "element_size") and hasattr(state, "numel"):  # a torch tensor
        return int(state.numel() * state.element_size())
    if hasattr(state, "nbytes") and isinstance(state.nbytes, int):  # a numpy array
        return int(state.nbytes)
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0
