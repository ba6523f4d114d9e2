"""Log-probabilities of the emitted tokens (OpenAI's ``logprobs`` / ``top_logprobs``), read from the
target's verify pass.

The law. The log-probability reported for a token emitted at a position whose history is ``h`` is

    log_softmax(process(logits_target(h), h) / T)[token]

where ``process`` is the request's logits processors (logit bias, penalties, a grammar's mask:
:mod:`specdecode.processors`) and ``T`` its temperature (``T = 1`` for greedy, ``temperature == 0``): the distribution the request
samples from *before truncation* (top-k, top-p, min-p). With no truncation it is exactly the law the
token was sampled from; with truncation it is the law the truncation is applied to, so a token outside
the kept set still has a finite value (OpenAI never reports ``-inf``). A token masked by a processor
(a ``-inf`` logit) has ``-inf``; it is never emitted, and is never listed among the top entries.
The values are always the target's (never the draft's), for every emitted token, accepted draft,
bonus or corrected token alike: under speculation the target's logits at every verified position are
already computed, processed with the drafted prefix of that position (which is the history the token
really has once the prefix is accepted), so they are taken from there, with no extra forward; a
request that asks for none costs nothing (:meth:`Engine._logprobs` runs only for rows that ask).
"""

from __future__ import annotations

import builtins
import codecs
import math
import re
from dataclasses import dataclass

import torch

LOGPROBS_MAX = 20  # the most top entries a request may ask for (OpenAI's top_logprobs range: 0..20)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its log-probability under the law above, and the ``top`` most likely
    tokens of that law as (id, log-probability), most likely first (as many as asked, finite ones only)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def law_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:  # [P, V] -> [P, V] float32
    """The reported law's log-probabilities of processed logits (module docstring): temperature only."""
    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature  # the same division as sampling.warp
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(
    logits: torch.Tensor,  # [P, V] processed logits of the positions the tokens were emitted at
    tokens: list[int],  # [P] the emitted tokens
    temperature: float,
    top_n: int,
) -> list[TokenLogprob]:
    """Each emitted token's :class:`TokenLogprob` under the law of the module docstring."""
    if not tokens:
        return []
    lp = law_logprobs(logits, temperature)  # [P, V]
    index = torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, index)[:, 0].tolist()
    if top_n <= 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    values, ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)  # [P, N], most likely first
    out = []
    for t, c, vs, ix in zip(tokens, chosen, values.tolist(), ids.tolist()):
        out.append(TokenLogprob(t, c, tuple((i, v) for i, v in zip(ix, vs) if v > -float("inf"))))
    return out


# -- reporting: token ids as text and bytes --------------------------------------------------------
REPORTED_FLOOR = -9999.0  # a non-finite value is reported as this (JSON has no -inf; vLLM's convention)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Spelling:
    """A token as reported: ``token`` its text (``bytes:\\xe2\\x80`` style when its bytes are not whole
    UTF-8, as vLLM writes them), ``bytes`` its own bytes, ``text_bytes`` what it adds to the output text
    (``b""`` for a special token, which the text skips)."""

    token: str
    bytes: builtins.bytes
    text_bytes: builtins.bytes


@dataclass(frozen=True)
class ReportedToken:
    """One emitted token ready for a response: its spelling and value, and its top entries'."""

    spelling: Spelling
    logprob: float
    top: tuple[tuple[Spelling, float], ...]


def reported(value: float) -> float:
    """A log-probability as a finite JSON number (``-inf``/NaN -> :data:`REPORTED_FLOOR`)."""
    return value if math.isfinite(value) else REPORTED_FLOOR


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level table: each byte -> the printable character a byte-level vocabulary spells it with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TokenSpeller:
    """Token ids -> :class:`Spelling`, each id worked out once (cached). A token's bytes are exact for
    byte-level BPE vocabularies (GPT-2, Qwen, Llama 3: the vocabulary entry mapped back through the byte
    table) and ``<0xNN>`` byte-fallback pieces; otherwise the UTF-8 of the piece with SentencePiece's
    ``▁`` as a space, or of the token decoded alone."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, Spelling] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_table = None
        if backend is not None and "ByteLevel(" in repr(backend.decoder):
            self._byte_table = {c: b for b, c in _bytes_to_unicode().items()}

    def spell(self, token_id: int) -> Spelling:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._spell(token_id)
        return found

    def _spell(self, token_id: int) -> Spelling:
        tok = self.tokenizer
        alone = tok.decode([token_id], skip_special_tokens=False)
        raw = self._bytes(token_id, alone)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        skipped = alone and not tok.decode([token_id], skip_special_tokens=True)
        return Spelling(text, raw, b"" if skipped else raw)

    def _bytes(self, token_id: int, alone: str) -> bytes:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # a tokenizer without pieces: the decoded text
            piece = None
        if isinstance(piece, str):
            if self._byte_table is not None and all(c in self._byte_table for c in piece):
                return bytes(self._byte_table[c] for c in piece)
            if m := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            if "\u2581" in piece:
                return piece.replace("\u2581", " ").encode("utf-8")
        return alone.encode("utf-8")

    def report(self, entry: TokenLogprob) -> ReportedToken:
        return ReportedToken(
            self.spell(entry.token_id),
            reported(entry.logprob),
            tuple((self.spell(i), reported(v)) for i, v in entry.top),
        )


def text_offsets(tokens: list[ReportedToken], decoder=None) -> tuple[list[int], object]:
    """Character offsets of each token in the output text (what the text held before it: whole characters
    only), continuing from ``decoder`` (an incremental UTF-8 decoder, returned for the next call)."""
    if decoder is None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.chars = 0
    out = []
    for t in tokens:
        out.append(decoder.chars)
        decoder.chars += len(decoder.decode(t.spelling.text_bytes))
    return out, decoder
