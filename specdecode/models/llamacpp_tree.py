"""Trees on llama.cpp: sequence ids per tree path, so that llama.cpp's own mask is the tree's mask.

llama.cpp builds the attention mask itself, from sequence ids and positions: a query token sees the
cache cells tagged with the query's (first) sequence id whose position is at most its own. It takes
no mask from the caller. With one KV stream shared by all sequences (``kv_unified``) a cell may
carry several ids, and that is enough to express any tree:

* each leaf of a forward's new nodes gets a sequence id of its own (from a pool past the slots'
  ids), and the cells on its root-to-leaf path carry it: the slot's committed cells and the path's
  cached nodes (``llama_memory_seq_cp`` from the deepest cached ancestor, up to its position), and
  the path's new nodes (their tokens list the id of every leaf below them);
* an inner node queries with the id of one leaf below it: cells of that id at positions up to the
  node's own are exactly the node's path (one node per position), so it sees its ancestors and
  itself; siblings share a position but never an id, so none sees another. Identical new nodes
  (same token, position and ancestors: a batch's padding) are computed once;
* a node's RoPE position is its place on its own path, so accepting a branch moves no K/V: the
  branch's id is copied onto the slot for the branch's positions; then every id of the slot's tree
  is removed, which frees the cells no id holds any more.

This module keeps the bookkeeping (which node sits at which write index, under which id, seeing
which nodes) and checks that a forward's tree mask is one llama.cpp can express: each query sees
exactly one node per position from the slot's committed length to its own position, and what it
sees of the cache is a cached node's whole path. :class:`~specdecode.models.llamacpp.LlamaCppRunner`
makes the llama.cpp calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.errors import UserError

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids of one context, slots and tree nodes together


class TreeUnsupported(UserError, ValueError):
    """A tree forward llama.cpp cannot express (or more tree nodes than it has sequence ids)."""


def check_ids(batch: int, leaves_per_row: int, what: str) -> None:
    """Refuse, before anything runs, a batch whose trees could need more sequence ids than a context has."""
    if batch * (1 + leaves_per_row) > MAX_SEQ:
        raise TreeUnsupported(
            f"trees on llama.cpp: {what} may need {leaves_per_row} sequence ids per row beside each "
            f"slot's own, {batch * (1 + leaves_per_row)} for a batch of {batch}, more than the "
            f"{MAX_SEQ} a llama.cpp context has; lower --max-batch-size, --tree-nodes, --tree-topk "
            "or the draft length"
        )


@dataclass(frozen=True)
class Node:
    seq: int  # a llama.cpp sequence id whose cells up to ``pos`` are this node's path (a leaf's below it)
    pos: int  # its RoPE position (the committed length + its depth on its path)
    sees: frozenset[int]  # write indices of its ancestors among the nodes, and its own


@dataclass
class RowPlan:
    """One row of a tree forward: what to run and what to change before it."""

    drop: list[tuple[int, int]] = field(default_factory=list)  # (id, from position): seq_rm before the rest
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (from id, to id, below position or -1): seq_cp
    tokens: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (token, position, ids), to decode
    query_token: list[int] = field(default_factory=list)  # per query of the row: its entry in ``tokens``


class NodeTable:
    """Tree nodes held in the cache, per slot, keyed by write index; and the pool of free ids."""

    def __init__(self, num_slots: int) -> None:
        if num_slots >= MAX_SEQ:
            raise TreeUnsupported(
                f"trees on llama.cpp need sequence ids for tree paths beside the slots' ids: at "
                f"most {MAX_SEQ - 1} slots, asked for {num_slots}"
            )
        self.num_slots = num_slots
        self.nodes: list[dict[int, Node]] = [{} for _ in range(num_slots)]
        self._free = list(range(MAX_SEQ - 1, num_slots - 1, -1))  # pop() takes the smallest

    def held(self, slot: int) -> bool:
        return bool(self.nodes[slot])

    def free_ids(self) -> int:
        return len(self._free)

    def plan(
        self,
        slot: int,
        committed: int,
        writes: list[int],
        tokens: list[int],
        positions: list[int],
        visible: list[set[int]],
    ) -> RowPlan:
        """Plan a tree forward of one row: query ``i`` writes ``tokens[i]`` at write index ``writes[i]``
        with RoPE position ``positions[i]`` and sees the nodes at the write indices ``visible[i]`` (of
        the window past the ``committed`` cells; itself implied)."""
        nodes = self.nodes[slot]
        first: dict[int, int] = {}
        for i, w in enumerate(writes):
            if w < committed:
                raise TreeUnsupported(
                    f"a tree node written at {w} would overwrite slot {slot}'s committed cache (length {committed})"
                )
            j = first.setdefault(w, i)
            if j != i and (tokens[j], positions[j], visible[j] - {w}) != (tokens[i], positions[i], visible[i] - {w}):
                raise TreeUnsupported(f"two different tree nodes at write index {w} in one forward")
        new = set(first)
        stale = {v for v, n in nodes.items() if v in new or n.sees & new}  # written over, or seeing such a node
        kept = {v: n for v, n in nodes.items() if v not in stale}

        order = sorted(new, key=lambda v: (positions[first[v]], first[v]))  # ancestors before descendants
        views: dict[int, frozenset[int]] = {}
        sources: dict[int, tuple[int, int]] = {}
        canon: dict[int, int] = {}  # write index -> the identical node computed in its place (itself mostly)
        seen: dict[tuple, int] = {}
        for w in order:
            i, p = first[w], positions[first[w]]
            view = frozenset(visible[i] | {w})
            cached = view - new
            missing = cached - kept.keys()
            if missing:
                raise TreeUnsupported(
                    f"the tree mask of slot {slot} names write indices {sorted(missing)} that hold no tree node"
                )
            path = sorted([positions[first[v]] for v in view & new] + [kept[v].pos for v in cached])
            if path != list(range(committed, p + 1)):
                raise TreeUnsupported(
                    "llama.cpp verifies trees whose nodes see exactly one node per position from the "
                    f"committed length {committed} to their own ({p}); slot {slot} asked for "
                    f"positions {path}"
                )
            if cached:
                top = max(cached, key=lambda v: kept[v].pos)
                if kept[top].sees != cached:
                    raise TreeUnsupported(f"a tree node of slot {slot} sees part of a cached node's path only")
                sources[w] = (kept[top].seq, kept[top].pos + 1)
            else:
                sources[w] = (slot, -1)
            for a in view & new - {w}:
                if not views[a] <= view:
                    raise TreeUnsupported(f"a tree node of slot {slot} sees a node but not that node's ancestors")
            views[w] = view
            ancestors = frozenset(canon[a] for a in view & new - {w})
            canon[w] = seen.setdefault((tokens[i], p, ancestors, cached), w)

        distinct = [w for w in order if canon[w] == w]
        above = {w: frozenset(canon[a] for a in views[w] & new) for w in distinct}  # in-batch ancestors and itself
        leaves = [w for w in distinct if not any(d != w and w in above[d] for d in distinct)]
        plan = RowPlan()
        by_id: dict[int, list[int]] = {}
        for v in stale:
            by_id.setdefault(nodes[v].seq, []).append(nodes[v].pos)
        freed = []
        for seq, stale_pos in sorted(by_id.items()):
            if any(n.seq == seq for n in kept.values()):  # the id is a kept node's path too: cut below it only
                plan.drop.append((seq, min(stale_pos)))
            else:
                plan.drop.append((seq, -1))
                freed.append(seq)
        if len(leaves) > len(self._free) + len(freed):
            raise TreeUnsupported(
                f"a tree forward with {len(leaves)} leaves needs more llama.cpp sequence ids than are "
                f"free ({len(self._free) + len(freed)} of {MAX_SEQ}, {self.num_slots} taken by slots): "
                "fewer tree nodes or a smaller batch"
            )
        for v in stale:
            del nodes[v]
        self._free = sorted(self._free + freed, reverse=True)
        leaf_id = {w: self._free.pop() for w in leaves}
        rep = {w: leaf_id[next(d for d in leaves if w in above[d])] for w in distinct}
        index = {w: n for n, w in enumerate(distinct)}
        for w in distinct:
            below = [leaf_id[d] for d in leaves if w in above[d] and leaf_id[d] != rep[w]]
            plan.tokens.append((tokens[first[w]], positions[first[w]], [rep[w], *below]))
        for d in leaves:
            src, hi = sources[d]
            plan.copies.append((src, leaf_id[d], hi))
        for w in order:
            nodes[w] = Node(rep[canon[w]], positions[first[w]], views[w])
        plan.query_token = [index[canon[w]] for w in writes]
        return plan

    def branch(self, slot: int, committed: int, writes: list[int]) -> tuple[int, int, int] | None:
        """The accepted branch whose last node is written at ``writes[-1]``: (an id holding its path,
        first position, one past the last), for copying onto the slot; ``writes`` must be that node's
        path past the committed cells, possibly without its first nodes (a root the caller keeps
        implicitly)."""
        if not writes:
            return None
        nodes = self.nodes[slot]
        if any(w not in nodes for w in writes):
            raise TreeUnsupported(
                f"slot {slot} holds no tree node at write indices {sorted(w for w in writes if w not in nodes)}"
            )
        last = nodes[writes[-1]]
        path = sorted(last.sees, key=lambda v: nodes[v].pos)
        if path[len(path) - len(writes) :] != list(writes) or [nodes[v].pos for v in path] != list(
            range(committed, last.pos + 1)
        ):
            raise TreeUnsupported(f"write indices {list(writes)} of slot {slot} are not a branch of its tree")
        return last.seq, committed, last.pos + 1

    def prefix_branch(self, slot: int, committed: int, length: int) -> tuple[int, int, int] | None:
        """What ``truncate(slot, length)`` keeps of the tree: the nodes written below ``length`` when they
        form a path whose write indices are their positions (a branch taken in node order)."""
        nodes = self.nodes[slot]
        kept = sorted(w for w in nodes if w < length)
        if not kept or kept != list(range(committed, committed + len(kept))):
            return None
        last = nodes[kept[-1]]
        if last.sees != frozenset(kept) or any(nodes[w].pos != w for w in kept):
            return None
        return last.seq, committed, last.pos + 1

    def release(self, slot: int) -> list[int]:
        """Forget the slot's nodes; their ids (to remove from the cache) go back to the pool."""
        seqs = sorted({n.seq for n in self.nodes[slot].values()})
        self.nodes[slot].clear()
        self._free = sorted(self._free + seqs, reverse=True)
        return seqs
