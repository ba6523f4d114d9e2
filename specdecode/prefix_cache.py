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
