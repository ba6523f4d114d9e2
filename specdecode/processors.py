"""Per-request logits processors (OpenAI's ``logit_bias``, ``presence_penalty``, ``frequency_penalty``;
vLLM's ``repetition_penalty``), applied exactly under speculation.

The law. At a position whose history is ``h`` (prompt, generated tokens, and the drafted tokens before
that position), a request samples from ``warp(process(logits, h))``, where ``process`` changes the raw
(pre-temperature) logits, in this order (vLLM's):

1. logit bias: ``logits[t] += bias[t]`` for each listed token;
2. repetition penalty ``r`` over prompt + generated tokens of ``h``: a seen token's logit ``x`` becomes
   ``x / r`` if ``x > 0``, else ``x * r``;
3. presence and frequency penalties over the *generated* tokens of ``h`` (the prompt does not count):
   ``logits[t] -= frequency * count[t] + presence * (count[t] > 0)``;

then :func:`specdecode.sampling.warp` (temperature, top-k, top-p, min-p). Greedy takes the argmax of the
processed logits.

Why it is exact. The verifier compares, at each drafted position ``j``, the target's law there with the
draft's. The target's law is computed with the history the position would have in target-only
decoding *if the drafts before it are accepted*: the committed tokens plus ``drafts[:j]`` (for a tree
node, the tokens of its ancestors). The verifier only uses position ``j``'s law once ``drafts[:j]``
have been accepted, so every law it uses is the target-only law of the history the output really has;
rejection sampling (and the coupled rule) then emit exactly that law. The drafter applies the same
processors to its own logits with its own drafted prefix, so the two laws match where the models do;
a drafter that does not (or a point-mass drafter: n-gram, suffix, Medusa) is still exact, only
accepted less often. ``specdecode check`` (part 7, :mod:`specdecode.check.processors`) proves it, with
controls that must fail: processors on the draft only, and the penalty state of the last committed
token used at every drafted position.

The protocol is made so that a stateful processor (a grammar: :class:`specdecode.grammar.GrammarProcessor`,
built here for a request with ``SamplingParams.grammar``) fits it: ``apply`` sees the drafted
prefix of each position and must leave its state as it was; ``commit`` advances it by the tokens a
step emitted. Neutral parameters build no processor at all (:func:`build_processors` returns ``()``),
and the engine and the drafters skip every call then: a plain request pays nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import torch
from torch import Tensor

from specdecode.sampling import SamplingParams

if TYPE_CHECKING:
    from specdecode.grammar import GrammarCompiler

Prefixes = Sequence[Sequence[int]]  # prefixes[p]: the drafted tokens between the committed ones and position p


class LogitsProcessor(Protocol):
    def apply(self, logits: Tensor, prefixes: Prefixes) -> Tensor:
        """``logits`` [P, V] raw logits of P positions of one request -> processed [P, V] (a new tensor;
        the input is not written). ``prefixes[p]`` = the drafted tokens between the request's committed
        tokens and position ``p`` (``()`` for the position right after them). Pure w.r.t. the state."""

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted (accepted drafts + the bonus token), in order."""


def _prefix_index(prefixes: Prefixes, device) -> tuple[Tensor, Tensor]:
    """(position [N], token [N]) of every token of every prefix: one scatter adds them all."""
    rows = [p for p, prefix in enumerate(prefixes) for _ in prefix]
    cols = [t for prefix in prefixes for t in prefix]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device)


class _OnDevice:
    """State tensors kept on the device of the logits they are applied to (moved once)."""

    _state: tuple[str, ...] = ()  # the attributes that hold them

    def _on(self, device) -> None:
        for name in self._state:
            t = getattr(self, name)
            if t.device != torch.device(device):
                setattr(self, name, t.to(device))


class LogitBias(_OnDevice):
    """``logits + bias`` (stateless)."""

    _state = ("bias",)

    def __init__(self, pairs: Sequence[tuple[int, float]], vocab_size: int) -> None:
        self.bias = torch.zeros(vocab_size)  # [V]
        self.bias[torch.tensor([t for t, _ in pairs], dtype=torch.long)] = torch.tensor([b for _, b in pairs])

    def apply(self, logits: Tensor, prefixes: Prefixes) -> Tensor:
        self._on(logits.device)
        return logits + self.bias.to(logits.dtype)

    def commit(self, tokens: Sequence[int]) -> None:
        pass


class RepetitionPenalty(_OnDevice):
    """vLLM / Hugging Face's repetition penalty over prompt + generated (+ drafted prefix) tokens."""

    _state = ("seen",)

    def __init__(self, penalty: float, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.penalty = penalty
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in the prompt or generated
        self.seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True

    def apply(self, logits: Tensor, prefixes: Prefixes) -> Tensor:
        self._on(logits.device)
        seen = self.seen.expand(logits.shape).clone()  # [P, V]
        seen[_prefix_index(prefixes, logits.device)] = True
        penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(seen, penalised, logits)

    def commit(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.seen[torch.tensor(list(tokens), dtype=torch.long, device=self.seen.device)] = True


class PresenceFrequencyPenalty(_OnDevice):
    """OpenAI's presence and frequency penalties over generated (+ drafted prefix) tokens."""

    _state = ("counts",)

    def __init__(self, presence: float, frequency: float, vocab_size: int) -> None:
        self.presence, self.frequency = presence, frequency
        self.counts = torch.zeros(vocab_size)  # [V] occurrences among the generated tokens

    def apply(self, logits: Tensor, prefixes: Prefixes) -> Tensor:
        self._on(logits.device)
        counts = self.counts.expand(logits.shape).clone()  # [P, V]
        rows, cols = _prefix_index(prefixes, logits.device)
        counts.index_put_((rows, cols), torch.ones(len(rows), device=logits.device), accumulate=True)
        return logits - (self.frequency * counts + self.presence * (counts > 0)).to(logits.dtype)

    def commit(self, tokens: Sequence[int]) -> None:
        if tokens:
            index = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
            self.counts.index_put_((index,), torch.ones(len(index), device=self.counts.device), accumulate=True)


def build_processors(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    vocab_size: int,
    grammars: GrammarCompiler | None = None,
    end_ids: Iterable[int] = (),
) -> tuple[LogitsProcessor, ...]:
    """A request's processors, in the order they apply; ``()`` for neutral parameters. Token ids must be
    inside the vocabulary (``Engine.validate`` refuses others first).

    A request with a ``grammar`` (:mod:`specdecode.grammar`) gets its :class:`GrammarProcessor` last, from
    ``grammars`` (its tokenizer's compiler); ``end_ids`` (the engine's EOS ids) and the request's
    ``stop_token_ids`` are allowed exactly where the output is complete. Raises GrammarError for a spec the
    engine cannot compile (a cached compile: ``Engine.validate`` compiled it first)."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        out.append(LogitBias(params.logit_bias, vocab_size))
    if params.repetition_penalty != 1:
        out.append(RepetitionPenalty(params.repetition_penalty, prompt_ids, vocab_size))
    if params.presence_penalty or params.frequency_penalty:
        out.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, vocab_size))
    if params.grammar is not None:  # last: masked entries stay -inf whatever the others add (order is moot)
        if grammars is None:
            raise ValueError("a request with a grammar needs its tokenizer's GrammarCompiler")
        out.append(grammars.processor(params.grammar, set(end_ids) | set(params.stop_token_ids)))
    return tuple(out)


def processors_of(view) -> tuple[LogitsProcessor, ...]:
    """A sequence's processors (a view that has none, e.g. a calibration view, has none)."""
    return getattr(view, "processors", ())


def apply_all(processors: Sequence[LogitsProcessor], logits: Tensor, prefixes: Prefixes) -> Tensor:  # [P, V]
    for proc in processors:
        logits = proc.apply(logits, prefixes)
    return logits


def process_batch(views: Sequence, logits: Tensor, prefixes: Sequence[Prefixes]) -> Tensor:
    """``logits`` [B, Q, V] of B sequences (``views``), ``prefixes[b][q]`` the drafted prefix of row b's
    position q: each row through its sequence's processors. Returns ``logits`` itself when no row has any."""
    if not any(processors_of(v) for v in views):
        return logits
    rows = [
        apply_all(processors_of(v), logits[b], prefixes[b]) if processors_of(v) else logits[b]
        for b, v in enumerate(views)
    ]
    return torch.stack(rows)


def process_rows(views: Sequence, logits: Tensor, prefixes: Prefixes) -> Tensor:
    """``logits`` [A, V], one position per sequence, ``prefixes[a]`` row a's drafted prefix."""
    if not any(processors_of(v) for v in views):
        return logits
    return process_batch(views, logits[:, None], [[p] for p in prefixes])[:, 0]


def chain_prefixes(tokens: Sequence[int], width: int) -> list[tuple[int, ...]]:
    """Prefixes of a chain's ``width`` positions: position j follows ``tokens[:j]``."""
    return [tuple(tokens[:j]) for j in range(width)]


def tree_prefixes(tokens: Sequence[int], parents: Sequence[int], num_nodes: int, width: int) -> list[tuple[int, ...]]:
    """Prefixes of a tree verify's ``width`` queries: query 0 is the pending token (``()``), query ``1 + i``
    node ``i``, followed by the tokens of its root-to-node path; queries past ``num_nodes`` get ``()``."""
    paths: dict[int, tuple[int, ...]] = {-1: ()}

    def path(i: int) -> tuple[int, ...]:
        if i not in paths:
            paths[i] = path(parents[i]) + (tokens[i],)
        return paths[i]

    return [()] + [path(i) for i in range(num_nodes)] + [()] * (width - 1 - num_nodes)
