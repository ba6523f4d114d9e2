"""A draft model with another tokenizer: ``--draft xvocab:MODEL`` (string-level exact match) and
``--draft xvocab-tli:MODEL`` (token-level intersection), exact for greedy and sampled decoding.

The draft runs in its own vocabulary on the sequence's *text*; each proposal is translated into target
token ids. The two lossless algorithms of Timor et al. (ICML 2025, "Accelerating LLM inference with
lossless speculative decoding algorithms for heterogeneous vocabularies"):

* **SLEM** (string-level exact match, ``xvocab``): the draft continues the text (greedy or sampled in its
  own vocabulary, warped like the target); the text is re-tokenized by the target's tokenizer after the
  committed tokens, and those target tokens are a **point-mass proposal** (``Proposal.probs = None``,
  like n-gram lookup).
* **TLI** (token-level intersection, ``xvocab-tli``): at each draft step the draft's warped law ``q`` is
  restricted to the tokens whose spelling (bytes; a special token's content) is a token of the target
  too, renormalised, ``q_I(v) = q(v) / q(I)``, and moved onto target ids (``v -> m(v)``, injective); a
  target token is drawn from it (the argmax of the restricted logits for greedy rows; the target's
  coupled noise for ``--sampler coupled``), the draft is fed its draft token, and the proposal carries
  the law, verified with ordinary rejection sampling. A row whose warped law puts no mass on the
  intersection ends its chain there.

Proof obligations (what makes both exact; ``check`` and ``tests/test_cross_vocab.py`` test them):

1. *A proposal never depends on the target's randomness at the positions it proposes.* Every draw of
   this drafter is taken from the request's generator before the verifier draws its uniforms, or from
   the coupled noise, and what is proposed is a function of the committed tokens and those draws.
2. *SLEM claims exactly what it samples from.* The proposed target token at each position is fixed
   given the prefix and the drafter's draws, so the law it was drawn from is a point mass; the
   verifier's ``probs=None`` rule (accept ``x`` with probability ``p(x)``, else draw from ``p`` without
   ``x``, renormalised) emits ``p(x)`` for ``x`` and ``(1 - p(x)) p(y) / (1 - p(x)) = p(y)`` for any
   other ``y``: the target's law, whatever ``x`` is. Nothing requires the re-tokenization to be
   canonical for exactness; canonical tokens only make acceptance likelier.
3. *TLI claims exactly what it samples from.* ``q_I`` sums to 1 over target ids (the restriction is
   renormalised, ``m`` is injective, rows with ``q(I) = 0`` propose nothing), the proposed token is drawn
   from ``q_I`` with the request's generator, and ``q_I`` is what ``Proposal.probs`` holds, so the
   verifier's rejection rule is Leviathan et al.'s with a proper draft distribution: exact. The law at
   position ``j`` depends only on the prefix (committed text and the proposal's first ``j`` tokens).
4. *Chains are conditioned correctly.* Position ``j`` is only verified after positions ``< j`` were
   accepted, i.e. when the sequence equals the proposal's prefix, which is the context the draft (and
   the proposal's law) used.

Negative controls (tests): TLI that claims the restriction *without* renormalising, and SLEM that
claims the draft's own laws moved onto target ids as if they were its proposal's law, both fail the
chi-square law test.

Text-boundary handling (these only affect acceptance, never exactness):

* **Bytes, not strings.** Every token is read as the bytes it spells (GPT-2 byte-level alphabets,
  SentencePiece ``▁`` and ``<0xNN>`` byte fallback, or the token string); added/special tokens are
  atomic units with their content. Specials cut the text into segments that are tokenized separately,
  and a target special maps to the draft's special of the same content, else to its content as text.
* **Merges across the boundary.** SLEM re-tokenizes a window of the target's recent text (the last
  ``WINDOW`` target tokens of the segment, from a character boundary) followed by the draft's text, and
  proposes the tokens after the committed window; a target token that would straddle the boundary
  (BPE would merge committed and drafted bytes) is replaced by the tokens of its drafted part. The last
  proposed token may still grow (``"hel"`` before ``"lo"``), so the draft runs one token more than asked
  and such a last token is dropped unless it is the only one.
* **Partial UTF-8.** Byte tokens that are not whole characters: the draft reads a trailing incomplete
  character as its own byte tokens when it has them, else owes those bytes (SLEM then requires its text
  to start with them; TLI proposes nothing that step); bytes that are not UTF-8 are read as byte tokens or
  skipped; a drafted text is cut before its first invalid byte before re-tokenization.
* **Re-synchronising the draft's KV.** Per slot the drafter keeps the target tokens it has read, the
  draft tokens of their text and *anchors*: points where both tokenizations have a boundary before a
  whitespace byte (or a special). After each step it re-tokenizes only from the last anchor not after the
  first changed target token, and the draft cache rolls back to the longest common prefix of the old and
  new draft tokens (:class:`~specdecode.drafters.draft_model.DraftModelDrafter`'s own rollback) and
  feeds the rest.

Chains only (``--tree-topk 1``); ``--draft-confidence`` applies to SLEM's draft chain.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Sequence, cast

import torch

from specdecode.drafters.autoregressive import draft_settings
from specdecode.drafters.base import DrafterBase, Proposal, SequenceView, common_prefix
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.models.base import Runner
from specdecode.sampling import SamplingParams, coupled_choice, race_noise, sample, warp, warp_tensors

MODES = ("slem", "tli")
WINDOW = 8  # target tokens of committed text re-tokenized with a SLEM proposal
EXTRA = 1  # draft tokens run past the requested length (so the last proposed token is rarely cut short)
WHITESPACE = frozenset(b" \t\n\r")


# -- a tokenizer as bytes ----------------------------------------------------------------------------
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte -> that byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer) -> set[str]:
    """The types in the fast tokenizer's decoder (nested sequences flattened)."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if "type" in node:
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder"))
    return found


class Vocab:
    """One tokenizer read as bytes: what each id spells, its special (added) tokens, its one-byte
    tokens, and encoding of arbitrary byte strings."""

    def __init__(self, tokenizer, rows: int | None = None) -> None:
        self.tokenizer = tokenizer
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        vocab = tokenizer.get_vocab()
        self.rows = max(rows or 0, max(vocab.values()) + 1)
        types = _decoder_types(tokenizer)
        alphabet = _byte_alphabet() if "ByteLevel" in types else None
        self.spell: list[bytes | None] = [None] * self.rows  # id -> bytes (None: special or undefined)
        for token, i in vocab.items():
            if i in added:
                continue
            if alphabet is not None:
                self.spell[i] = bytes(alphabet.get(c, 0) for c in token) if all(c in alphabet for c in token) else None
            elif "ByteFallback" in types and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                self.spell[i] = bytes([int(token[3:5], 16)])
            else:
                self.spell[i] = (
                    token.replace("▁", " ").encode() if "Metaspace" in types or "Replace" in types else token.encode()
                )
        self.special: dict[int, str] = added  # id -> content
        self.special_id: dict[str, int] = {content: i for i, content in sorted(added.items(), reverse=True)}
        self.by_spelling: dict[bytes, int] = {}
        for i, s in enumerate(self.spell):
            if s is not None and s not in self.by_spelling:
                self.by_spelling[s] = i
        self.byte_id = {s[0]: i for s, i in self.by_spelling.items() if len(s) == 1}

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def encode_bytes(self, data: bytes) -> tuple[list[int], list[int]]:
        """Token ids of ``data`` and the byte offset each ends at (an end is ``-1`` where the tokenizer does
        not spell its input back): UTF-8 runs through the tokenizer, other bytes as one-byte tokens,
        skipped when there is none."""
        ids: list[int] = []
        ends: list[int] = []
        text = data.decode("utf-8", "surrogateescape")  # a byte that is not UTF-8 -> U+DC80..U+DCFF
        pos = 0
        for run in re.split(r"([\udc80-\udcff])", text):
            if not run:
                continue
            if len(run) == 1 and "\udc80" <= run <= "\udcff":
                pos += 1
                if (run_id := self.byte_id.get(ord(run) - 0xDC00)) is not None:
                    ids.append(run_id)
                    ends.append(pos)
                continue
            run_ids = self.encode_text(run)
            spells = [self.spell[i] for i in run_ids]
            known = cast("list[bytes]", spells)  # (read only where None is not in spells)
            size = len(run.encode())
            if None not in spells and sum(map(len, known)) == size:
                ends.extend(pos + end for end in itertools.accumulate(map(len, known)))
            elif run_ids:
                ends.extend([-1] * (len(run_ids) - 1) + [pos + size])
            ids.extend(run_ids)
            pos += size
        return ids, ends


_VOCABS: dict[tuple[int, int], tuple[object, Vocab]] = {}  # (id(tokenizer), rows) -> (tokenizer, its Vocab)


def vocab_of(tokenizer, rows: int | None = None) -> Vocab:
    """The :class:`Vocab` of a tokenizer, built once per tokenizer object (a few seconds at 150k tokens;
    ``check`` and ``bench`` build many engines over one load)."""
    key = (id(tokenizer), rows or 0)
    if key not in _VOCABS or _VOCABS[key][0] is not tokenizer:
        _VOCABS[key] = (tokenizer, Vocab(tokenizer, rows))
    return _VOCABS[key][1]


def incomplete_tail(data: bytes) -> int:
    """How many trailing bytes of ``data`` begin a UTF-8 character they do not finish (0..3)."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 1
        return back if need > back else 0
    return 0


def valid_prefix(data: bytes) -> int:
    """The length of the longest prefix of ``data`` that is whole UTF-8 characters."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return len(data)


# -- per-slot reading of the text --------------------------------------------------------------------
@dataclass
class TextState:
    """What the drafter has read of one sequence."""

    target: list[int] = field(default_factory=list)  # target tokens read (a prefix of the sequence)
    draft: list[int] = field(default_factory=list)  # the draft's tokens for their text
    anchors: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])  # (target, draft) cut points
    owed: bytes = b""  # trailing bytes of the text the draft could not read (an unfinished character)


@dataclass
class DraftView:
    """A sequence as the draft model sees it: the same slot, request and generator, draft token ids."""

    slot: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator


class Translator:
    """Target tokens -> the draft's tokens (incrementally, per slot), and drafted text -> target tokens."""

    def __init__(self, target: Vocab, draft: Vocab) -> None:
        self.target, self.draft = target, draft

    def read(self, state: TextState, token_ids: list[int]) -> TextState:
        """``state`` moved to ``token_ids``: re-tokenized from the last anchor not after the first change."""
        changed = common_prefix(state.target, token_ids)
        at = bisect.bisect_right(state.anchors, (changed, float("inf"))) - 1
        t0, d0 = state.anchors[at]
        draft, anchors, owed = self._tokens(token_ids[t0:], t0, d0)
        return TextState(list(token_ids), state.draft[:d0] + draft, state.anchors[: at + 1] + anchors, owed)

    def _tokens(self, ids: list[int], t0: int, d0: int) -> tuple[list[int], list[tuple[int, int]], bytes]:
        """The draft's tokens for target tokens ``ids`` (the first at index ``t0``, its draft tokens
        continuing at ``d0``), the anchors inside them and the bytes owed at the end."""
        out: list[int] = []
        anchors: list[tuple[int, int]] = []
        run = bytearray()  # ordinary text since the last special
        ends: list[tuple[int, int]] = []  # (target index after, byte end)

        def flush(final: bool) -> bytes:
            tail = incomplete_tail(bytes(run)) if final else 0
            body = bytes(run[: len(run) - tail])
            toks, tok_ends = self.draft.encode_bytes(body)
            target_ends = {end: t for t, end in ends}
            for j, end in enumerate(tok_ends):  # a cut point: both tokenizations end here, a word starts next
                if 0 < end < len(body) and body[end] in WHITESPACE and end in target_ends:
                    anchors.append((target_ends[end], d0 + len(out) + j + 1))
            out.extend(toks)
            owed = bytes(run[len(run) - tail :]) if tail else b""
            if owed and all(b in self.draft.byte_id for b in owed):
                out.extend(self.draft.byte_id[b] for b in owed)
                owed = b""
            run.clear()
            ends.clear()
            return owed

        for i, t in enumerate(ids):
            content = self.target.special.get(t)
            if content is None:
                run.extend(self.target.spell[t] or b"")
                ends.append((t0 + i + 1, len(run)))
                continue
            flush(final=False)
            special = self.draft.special_id.get(content)
            out.extend([special] if special is not None else self.draft.encode_bytes(content.encode())[0])
            anchors.append((t0 + i + 1, d0 + len(out)))
        return out, anchors, flush(final=True)

    def window(self, token_ids: list[int]) -> bytes:
        """The committed text a SLEM proposal is re-tokenized after: the last ``WINDOW`` target tokens,
        not across a special, from just after the last byte that is not UTF-8 (a trailing unfinished
        character excepted)."""
        parts = []
        for t in reversed(token_ids[-WINDOW:]):
            spelled = self.target.spell[t] if t not in self.target.special else None
            if spelled is None:
                break
            parts.append(spelled)
        data = b"".join(reversed(parts))
        body = data[: len(data) - incomplete_tail(data)]
        start = 0
        while (good := valid_prefix(body[start:])) < len(body) - start:
            start += good + 1
        return data[start:]

    def to_target(self, token_ids: list[int], owed: bytes, drafted: list[int], k: int) -> list[int]:
        """SLEM: the target tokens of the text the draft tokens ``drafted`` spell after ``token_ids``
        (at most ``k``)."""
        text, stop = bytearray(), None
        for d in drafted:
            if d in self.draft.special:
                stop = self.target.special_id.get(self.draft.special[d])
                break
            if (spelled := self.draft.spell[d] if d < len(self.draft.spell) else None) is None:
                break
            text.extend(spelled)
        if not text.startswith(owed):
            return []
        window = self.window(token_ids)
        whole = window + bytes(text[len(owed) :])
        cut = valid_prefix(whole)
        out: list[int] = []
        if cut > len(window):
            ids = self.target.encode_text(whole[:cut].decode())
            spells = [self.target.spell[i] for i in ids]
            known = cast("list[bytes]", spells)  # (read only where None is not in spells)
            if None in spells or sum(map(len, known)) != cut:  # not spelled back (a normalizer, a special): none
                return []
            ends = list(itertools.accumulate(map(len, known)))
            first = next(i for i, end in enumerate(ends) if end > len(window))
            begin = ends[first - 1] if first else 0
            out = (
                ids[first:]
                if begin == len(window)
                else self.target.encode_bytes(whole[len(window) : ends[first]])[0] + ids[first + 1 :]
            )
        if stop is not None and cut == len(whole):
            out.append(stop)
        elif 1 < len(out) <= k:
            out.pop()  # it ends where the drafted text ends: more text could have merged into it
        return out[:k]

    def shared(self, draft_rows: int, target_rows: int) -> torch.Tensor:  # [draft_rows] long, -1 = none
        """TLI's map ``m``: each draft id whose spelling (a special's content) is a target token -> that id."""
        to_target = torch.full((draft_rows,), -1, dtype=torch.long)
        for d, spelled in enumerate(self.draft.spell[:draft_rows]):
            t = self.target.by_spelling.get(spelled) if spelled is not None else None
            if t is not None and t < target_rows:
                to_target[d] = t
        for d, content in self.draft.special.items():
            t = self.target.special_id.get(content)
            if d < draft_rows and t is not None and t < target_rows:
                to_target[d] = t
        return to_target


# -- the drafter -------------------------------------------------------------------------------------
class CrossVocabDrafter(DraftModelDrafter):
    """A draft model with its own tokenizer (see the module docstring). It is a
    :class:`DraftModelDrafter` over the draft's token ids (its KV cache and rollback), fed with the
    sequence's text re-tokenized per slot; ``mode`` is ``"slem"`` or ``"tli"``."""

    name = "xvocab"
    lazy_start = True  # like the draft model: it can start late and catch up (drafters.multi)
    # no prefix cache: its cache is in the draft's token ids, while the engine names a prompt in the target's
    keep_prefixes = DrafterBase.keep_prefixes
    restore = DrafterBase.restore

    def __init__(
        self,
        runner: Runner,
        target_tokenizer,
        draft_tokenizer,
        target_vocab_size: int,
        mode: str = "slem",
        confidence: float = 0.0,
        tokens_per_target: float = 2.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"cross-vocabulary mode must be one of {', '.join(MODES)}, got {mode!r}")
        super().__init__(runner, None, confidence)
        self.mode = mode
        self.name = "xvocab" if mode == "slem" else "xvocab-tli"
        self.target_vocab_size = target_vocab_size
        self.tokens_per_target = tokens_per_target  # draft cache positions reserved per target position
        self.translator = Translator(
            vocab_of(target_tokenizer, target_vocab_size), vocab_of(draft_tokenizer, runner.vocab_size)
        )
        self._text: dict[int, TextState] = {}
        if mode == "tli":
            self.to_target = self.translator.shared(runner.vocab_size, target_vocab_size)  # [Vd]
            self.from_target = torch.full((target_vocab_size,), -1, dtype=torch.long)  # [Vt]
            shared = (self.to_target >= 0).nonzero().flatten()
            self.from_target[self.to_target[shared]] = shared
            if not len(shared):
                raise ValueError("the two vocabularies share no token: token-level intersection cannot draft")

    def runners(self) -> dict[str, Runner]:
        # its own role name: the runner scores the draft's token ids, not the target's (``check`` ranks contexts
        # with a same-vocabulary "draft" runner only)
        return {"draft (own vocabulary)": self.runner}

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.runner.ensure_capacity(num_slots, int(max_len * self.tokens_per_target) + 2 * EXTRA + 2)

    def _view(self, s: SequenceView) -> DraftView:
        """The sequence in draft tokens, its text re-read; the draft cache rolled back to the longest common
        prefix of what it holds and those tokens, short of the last one (fed next, for the logits after it).
        (The draft model's own rollback assumes a sequence only grows; re-tokenized text may change
        before its end, so the agreeing length is set here.)"""
        state = self._text[s.slot] = self.translator.read(self._text.get(s.slot, TextState()), s.token_ids)
        cached = self._cached.get(s.slot, [])  # (a slot first seen here, by a late start, holds nothing)
        keep = min(common_prefix(cached, state.draft), max(0, len(state.draft) - 1))
        if keep < len(cached):
            self.runner.truncate(s.slot, keep)
        self._cached[s.slot], self._floor[s.slot] = cached[:keep], keep
        return DraftView(s.slot, state.draft, s.params, s.generator)

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        for slot in slots:
            self._text.pop(slot, None)
        views = [self.translator.read(TextState(), p) for p in prompts]
        for slot, state in zip(slots, views):
            self._text[slot] = state
        super().start(slots, [state.draft or [0] for state in views])

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        self._text[dst] = self._text.pop(src)

    def release(self, slot: int) -> None:
        super().release(slot)
        self._text.pop(slot, None)

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        return False  # a prompt is read whole at ``start`` (pieces of target tokens are not whole text)

    def lag(self, seq: SequenceView) -> int:
        """Draft tokens the next proposal must read beyond the usual one or two."""
        view = self._view(seq)
        return max(0, len(view.token_ids) - len(self._cached[seq.slot]) - 2)

    def read(self, seqs: Sequence[SequenceView], budget: int) -> int:
        """Read up to ``budget`` draft tokens of the text the cache lacks, without drafting (a late start in
        pieces: :meth:`DraftModelDrafter.read` over the sequences in draft tokens)."""
        return super().read([self._view(s) for s in seqs], budget)

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        bsz = len(seqs)
        rows, views = [], []
        for b, s in enumerate(seqs):
            if num_tokens[b] <= 0:
                continue
            view = self._view(s)
            room = len(view.token_ids) + num_tokens[b] + 2 * EXTRA + 1 < self.runner.max_len
            if view.token_ids and room and not (self.mode == "tli" and self._text[s.slot].owed):
                rows.append(b)
                views.append(view)
        tokens = torch.zeros(bsz, max(num_tokens, default=0), dtype=torch.long)
        num = torch.zeros(bsz, dtype=torch.long)
        if not rows:
            return Proposal(tokens, None, num)
        if self.mode == "tli":
            return self._propose_tli(seqs, rows, views, num_tokens, tokens, num)
        drafted = super().propose(views, [num_tokens[b] + EXTRA for b in rows])
        for i, b in enumerate(rows):
            s = seqs[b]
            out = self.translator.to_target(
                s.token_ids,
                self._text[s.slot].owed,
                drafted.tokens[i, : int(drafted.num_tokens[i])].tolist(),
                num_tokens[b],
            )
            tokens[b, : len(out)] = torch.tensor(out, dtype=torch.long)
            num[b] = len(out)
        width = int(num.max())
        return Proposal(tokens[:, :width], self._slem_law(drafted, rows, bsz, width), num)

    def _slem_law(self, drafted: Proposal, rows: list[int], bsz: int, width: int) -> torch.Tensor | None:
        """What a SLEM proposal claims it was drawn from: a point mass (``None``). (A test overrides it
        with the draft's own laws, the negative control.)"""
        return None

    def _propose_tli(
        self,
        seqs: Sequence[SequenceView],
        rows: list[int],
        views: list[DraftView],
        num_tokens: list[int],
        tokens: torch.Tensor,
        num: torch.Tensor,
    ) -> Proposal:
        """TLI: each step draws a target token from the draft's law on the shared tokens, renormalised."""
        active = [seqs[b] for b in rows]
        ks = [num_tokens[b] for b in rows]
        params = [s.params for s in active]
        all_greedy = all(p.greedy for p in params)
        laws_of = warp_tensors(params)
        greedy = torch.tensor([p.greedy for p in params])
        coupled = [i for i, p in enumerate(params) if p.coupled]
        uniforms = torch.zeros(len(active), max(ks))
        for i, s in enumerate(active):
            if not s.params.greedy and not s.params.coupled:
                uniforms[i, : ks[i]] = torch.rand(ks[i], generator=s.generator)
        shared = self.to_target >= 0  # [Vd]
        logits = self._logits(self._catch_up(views))  # [A, Vd]
        slots = torch.tensor([v.slot for v in views])
        starts = torch.tensor([len(v.token_ids) for v in views])  # where the first draft token goes
        alive = torch.ones(len(active), dtype=torch.bool)
        laws = torch.zeros(len(active), max(ks), self.target_vocab_size) if not all_greedy else None
        fed: list[list[int]] = [[] for _ in active]
        for j in range(max(ks)):
            restricted = logits.float().masked_fill(~shared.to(logits.device), -float("inf")).cpu()  # [A, Vd]
            alive &= torch.isfinite(restricted.max(-1).values) & (torch.tensor(ks) > j)
            choice = restricted.argmax(-1)  # greedy rows
            if laws is not None:
                law = warp(logits.float().cpu(), *laws_of)  # [A, Vd] the draft's law
                mass = (law * shared).sum(-1)  # [A] q(I)
                alive &= greedy | (mass > 0)
                law_t = torch.zeros(len(active), self.target_vocab_size)  # [A, Vt] q_I moved onto target ids
                law_t[:, self.to_target[shared]] = law[:, shared] / mass.clamp_min(1e-30)[:, None]
                drawn = self.from_target[sample(law_t, uniforms[:, j])]
                for i in coupled:
                    seed = cast(int, params[i].seed)  # the engine gives every coupled request one (Engine._resolve)
                    noise = race_noise(seed, len(active[i].token_ids) + j, self.target_vocab_size)
                    drawn[i] = self.from_target[coupled_choice(law_t[i : i + 1], noise[None])[0]]
                choice = torch.where(greedy, choice, drawn)
                law_t[greedy] = 0.0
                law_t[greedy, self.to_target[choice[greedy]]] = 1.0
                laws[:, j] = self._claim(law_t, mass)
            for i in alive.nonzero().flatten().tolist():
                tokens[rows[i], j] = int(self.to_target[choice[i]])
                num[rows[i]] = j + 1
                fed[i].append(int(choice[i]))
            if j + 1 == max(ks) or not alive.any():
                break
            step = choice.to(self.runner.device)
            logits = self._logits(self.runner.forward(slots, step[:, None], (starts + j)[:, None]).hidden[:, 0])
        for i, v in enumerate(views):  # what the draft cache now holds (the last proposed token was never fed)
            self._cached[v.slot] = v.token_ids + fed[i][: max(0, len(fed[i]) - 1)]
            self._floor[v.slot] = len(v.token_ids)
        width = int(num.max())
        probs = None
        if laws is not None:
            probs = torch.zeros(len(seqs), width, self.target_vocab_size)
            probs[rows] = laws[:, :width]
        return Proposal(tokens[:, :width], probs, num)

    @staticmethod
    def _claim(law_t: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:  # [A, Vt]
        """The law a TLI token is verified against: the one it was drawn from. (A test overrides it with
        the restriction left unnormalised, ``law_t * mass``, the negative control.)"""
        return law_t


def _build(arg: str, ctx, mode: str) -> CrossVocabDrafter:
    from specdecode.drafters import DraftSpecError

    settings = draft_settings(ctx.config)
    if settings["tree_topk"] > 1:
        raise DraftSpecError("a cross-vocabulary draft proposes chains: drop --tree-topk")
    if ctx.tokenizer is None or ctx.draft_tokenizer is None:
        raise DraftSpecError("a cross-vocabulary draft needs both tokenizers, and the context holds none")
    return CrossVocabDrafter(
        ctx.draft_runner(), ctx.tokenizer, ctx.draft_tokenizer, ctx.target.vocab_size, mode, settings["confidence"]
    )


def build(arg: str, ctx) -> CrossVocabDrafter:
    """``--draft xvocab:MODEL``: string-level exact match (SLEM)."""
    return _build(arg, ctx, "slem")


def build_tli(arg: str, ctx) -> CrossVocabDrafter:
    """``--draft xvocab-tli:MODEL``: token-level intersection (TLI)."""
    return _build(arg, ctx, "tli")
