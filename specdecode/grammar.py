"""Structured outputs: grammars that mask each position's law, exactly under speculation (issue 40).

A request that asks for JSON (OpenAI's ``response_format``), a regex or a grammar samples, at each
position, from its law with every token the grammar forbids after that position's history set to
``-inf``. Under speculation the history of a verified position is the committed tokens *plus the drafted
prefix before it*, so :class:`GrammarProcessor` masks position ``p`` with the grammar state after
``prefixes[p]`` (the :class:`specdecode.processors.LogitsProcessor` protocol); the drafter's law is masked
the same way. Only the emitted tokens (``commit``) move the state for good. Why this is exact, and what
is wired where: ``docs/structured-outputs.md``.

The engine is llguidance (pinned in ``pyproject.toml``), chosen over xgrammar 0.2.9 on a measurement
(``docs/bench/structured/avx2-mask-time``: AVX2-only EPYC, Qwen2.5's vocabulary with 151,936-wide
logits, one thread, steady cost per token): masks cost the same on JSON (schema 18 vs 14 µs,
``json_object`` 21 vs 37 µs; xgrammar wins on a regex, 3 vs 88 µs), all well under 1 % of a target step
on a CPU; rollback is under 1 µs in both; a schema reaches its first mask in 1-8 ms against xgrammar's
35-56 ms compile, paid on the request's time to first token. What decides is installation: llguidance
is one abi3 wheel with no dependencies, while xgrammar requires triton (285 MB) on x86-64 Linux and
apache-tvm-ffi, and CI installs everything on a 2-core CPU box. llguidance also reads GBNF as well as
its Lark-like grammars, and says what is wrong with a schema or grammar in words we pass on.

Tokenizers: llguidance reads a Hugging Face *fast* tokenizer's JSON (byte-level BPE like Qwen's and
GPT-2's, SentencePiece-style Metaspace/byte fallback). A tokenizer it cannot read (e.g. the toy
backend's one-token-per-character WordLevel with a ``Fuse`` decoder) falls back to each token's decoded
text, which is exact for tokenizers whose decoder concatenates tokens.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from specdecode.errors import UserError
from specdecode.extras import MissingExtra
from specdecode.grammar_bounds import BoundExceeded, GrammarLimits, check_bounds
from specdecode.grammar_worker import (
    WHITESPACE,
    GrammarSandbox,
    SandboxRefused,
    _heap_bytes,
    build_ll_tokenizer,
    error_line,
    first_mask_problem,
    llguidance_grammar,
    parser_limits,
)

try:
    import llguidance
except ModuleNotFoundError as exc:  # structured outputs are an extra
    raise MissingExtra("llguidance", "structured", "structured outputs") from exc

Prefixes = Sequence[Sequence[int]]  # prefixes[p]: the drafted tokens between the committed ones and position p

KINDS = ("json_schema", "regex", "grammar")


class GrammarError(UserError, ValueError):
    """An invalid ``response_format``, JSON schema, regex or grammar; the message is the engine's own."""


WHITESPACE_MODES = tuple(WHITESPACE)  # a JSON spec's whitespace between tokens: bounded (default), flexible, compact


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match; hashable (the compiler cache's key).

    ``kind`` is ``json_schema`` (``text`` = the schema as compact JSON, keys in their order), ``regex`` (Rust ``regex``
    syntax, matched against the whole output: no look-around or back-references) or ``grammar``
    (llguidance's Lark-like syntax, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md,
    or a llama.cpp GBNF grammar, told apart by the engine; start symbol ``start`` / ``root``).

    ``whitespace`` (JSON only): what may stand between JSON tokens. ``bounded`` (the default, as llama.cpp's
    schema grammars): one space, or one or two newlines and at most 20 spaces or tabs, at each place JSON
    allows whitespace; ``flexible``: any run of JSON whitespace (llguidance's default); ``compact``: none.
    A schema's own top-level ``"x-guidance"`` whitespace setting wins over it.
    """

    kind: str
    text: str
    whitespace: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise GrammarError(f"a {self.kind} must be a non-empty string")
        if self.kind == "json_schema" and self.whitespace is None:
            object.__setattr__(self, "whitespace", "bounded")
        if self.kind == "json_schema" and self.whitespace not in WHITESPACE_MODES:
            raise GrammarError(f"whitespace must be one of {', '.join(WHITESPACE_MODES)}, got {self.whitespace!r}")
        if self.kind != "json_schema" and self.whitespace is not None:
            raise GrammarError(f"whitespace applies to JSON outputs only, not to a {self.kind}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str, whitespace: str = "bounded") -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise GrammarError("the JSON schema nests too deeply to read") from None
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:  # keys keep their order: the engine emits properties in the schema's order
            text = json.dumps(schema, separators=(",", ":"))
        except RecursionError:
            raise GrammarError("the JSON schema nests too deeply to read") from None
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        return cls("json_schema", text, whitespace)

    @classmethod
    def json_object(cls, whitespace: str = "bounded") -> "GrammarSpec":
        """OpenAI's JSON mode: any JSON object."""
        return cls.json_schema({"type": "object"}, whitespace)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "GrammarSpec":
        return cls("grammar", text)

    @classmethod
    def from_response_format(cls, obj: Any, whitespace: str = "bounded") -> "GrammarSpec | None":
        """OpenAI's ``response_format``: ``{"type": "text"}`` -> None; ``{"type": "json_object"}``;
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.
        ``strict`` may be true, false or absent: the schema is enforced as written either way (a
        grammar cannot enforce less); ``name`` and ``description`` are not used."""
        if not isinstance(obj, Mapping):
            raise GrammarError(f"response_format must be an object, got {type(obj).__name__}")
        kind = obj.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(whitespace)
        if kind != "json_schema":
            raise GrammarError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        inner = obj.get("json_schema")
        if not isinstance(inner, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        if "name" in inner and not isinstance(inner["name"], str):
            raise GrammarError("response_format.json_schema.name must be a string")
        if inner.get("strict") not in (None, True, False):
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        if "schema" not in inner:
            raise GrammarError("response_format.json_schema.schema is required")
        return cls.json_schema(inner["schema"], whitespace)

    def llguidance_grammar(self) -> str:
        """The engine's grammar text (not yet validated)."""
        try:
            return llguidance_grammar(self.kind, self.text, self.whitespace)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"invalid {self.kind}: {e}") from None


# --- bitmasks -----------------------------------------------------------------------------------------


def bitmask_to_bool(bitmask: Tensor, width: int) -> Tensor:
    """``bitmask`` [P, ceil(V / 32)] int32 on the CPU (bit ``t % 32`` of word ``t // 32`` = token ``t``
    allowed) -> [P, width] bool; ids at or past ``32 * words`` are False. numpy's ``unpackbits``: about
    0.1 ms for 9 rows of 152k tokens (a gather through a byte table is 6x slower in torch)."""
    P, words = bitmask.shape
    packed = bitmask.contiguous().numpy().view(np.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
    allowed = torch.from_numpy(np.unpackbits(packed, axis=1, count=min(width, 32 * words), bitorder="little"))
    allowed = allowed.view(torch.bool)
    if allowed.shape[1] < width:
        allowed = torch.cat([allowed, allowed.new_zeros(P, width - allowed.shape[1])], dim=1)
    return allowed


def apply_bitmask_(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Set the disallowed entries of ``logits`` [P, W] to -inf in place (ids past the mask are
    disallowed); returns ``logits``."""
    allowed = bitmask_to_bool(bitmask, logits.shape[1]).to(logits.device)
    return logits.masked_fill_(allowed.logical_not_(), float("-inf"))


# --- tokenizers and compiled grammars -----------------------------------------------------------------


def _eos_ids(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return tuple(int(x) for x in ([] if eos is None else [eos] if isinstance(eos, int) else eos))


def _ll_tokenizer(tokenizer, eos_id: int) -> tuple["llguidance.LLTokenizer", dict[str, Any]]:
    """llguidance's tokenizer and the recipe a sandbox child builds it from: the fast tokenizer's JSON, or
    (a decoder llguidance does not read) each token's decoded text, exact when the decoder concatenates."""
    n = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        recipe = {"json": backend.to_str(), "n_vocab": n, "eos": eos_id}
        try:
            return build_ll_tokenizer(recipe), recipe
        except ValueError:
            pass  # fall back to the decoded tokens
    special = sorted(set(getattr(tokenizer, "all_special_ids", ())) & set(range(n)))
    tokens = [b"" if i in special else tokenizer.decode([i]).encode() for i in range(n)]
    recipe = {
        "tokens": [t.hex() for t in tokens],
        "n_vocab": n,
        "eos": eos_id,
        "bos": getattr(tokenizer, "bos_token_id", None),
        "special": special,
    }
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return build_ll_tokenizer(recipe, encode), recipe


@dataclass
class _Entry:
    """A validated spec: llguidance's grammar text, and matchers compiled ahead (first mask computed),
    each handed out once. ``matcher_bytes``: the estimated memory of one of them."""

    grammar: str
    matcher_bytes: int
    ready: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return len(self.grammar) + self.matcher_bytes * len(self.ready)


class GrammarCompiler:
    """One tokenizer's grammar engine: its llguidance tokenizer (1.5-4 s to build for 152k tokens on a
    2-core CPU, once: build it with the engine) and a cache of validated specs.

    Every request gets a **fresh matcher of its own**, compiled from the spec's validated grammar text: no
    lexer state is shared between requests (llguidance's ``deep_copy`` shares the lexer's lazily built
    states, so one request that drives a shared spec into a lexer limit would break every later copy).
    A new spec is checked first: its size and chain depths against :class:`GrammarLimits` (in Python),
    then compiled with its first mask computed — in the sandbox child (:meth:`start_sandbox`, what the
    server does: a native crash, a time or a memory overrun there costs the child only) or in-process.
    Anything wrong is a GrammarError naming the engine's words or the bound; nothing that failed is cached.

    The cache (LRU) keeps each validated spec's grammar text and up to ``ready_per_spec`` matchers compiled
    ahead by :meth:`prepare` (off the engine thread: the server calls it in a request thread), bounded in
    entries and in estimated bytes. Thread-safe.

    ``eos_ids``: the tokens that end a generation (default: the tokenizer's EOS); they are allowed exactly
    where the grammar is complete (with a request's ``stop_token_ids``: :meth:`processor`)."""

    def __init__(
        self,
        tokenizer,
        *,
        eos_ids: Iterable[int] | None = None,
        limits: GrammarLimits | None = None,
        cache_size: int | None = None,
    ):
        self.eos_ids = tuple(sorted(set(eos_ids if eos_ids is not None else _eos_ids(tokenizer))))
        if not self.eos_ids:
            raise GrammarError("structured outputs need a tokenizer with an EOS token")
        limits = limits or GrammarLimits()
        self.limits = limits if cache_size is None else replace(limits, cache_entries=cache_size)
        self.vocab_size = len(tokenizer)
        self.ll_tokenizer, self._recipe = _ll_tokenizer(tokenizer, self.eos_ids[0])
        self._parser_limits = parser_limits(self.limits.parser_dict())
        self._cache: OrderedDict[GrammarSpec, _Entry] = OrderedDict()
        self._approved: OrderedDict[bytes, None] = OrderedDict()  # digests of the specs that passed once
        self._lock = threading.Lock()
        self.sandbox: GrammarSandbox | None = None

    @property
    def cache_size(self) -> int:
        return self.limits.cache_entries

    @property
    def cache_bytes(self) -> int:
        """The cache's estimated bytes now."""
        with self._lock:
            return sum(e.bytes for e in self._cache.values())

    def start_sandbox(self, *, fault_marker: str | None = None) -> GrammarSandbox:
        """From now on a new spec is compiled first in a child process (:mod:`specdecode.grammar_worker`);
        the child starts now (it builds the tokenizer). Idempotent."""
        with self._lock:
            if self.sandbox is None:
                self.sandbox = GrammarSandbox(
                    self._recipe,
                    self.eos_ids,
                    self.limits.parser_dict(),
                    time_budget_s=self.limits.time_budget_s,
                    memory_budget_bytes=self.limits.memory_budget_bytes,
                    max_matcher_bytes=self.limits.max_matcher_bytes,
                    wall_limit_s=self.limits.wall_limit_s,
                    fault_marker=fault_marker,
                )
            sandbox = self.sandbox
        sandbox.start()
        return sandbox

    def close(self) -> None:
        """Stop the sandbox child, if any."""
        if self.sandbox is not None:
            self.sandbox.close()

    def _new_matcher(self, grammar: str) -> "llguidance.LLMatcher":
        return llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._parser_limits)

    @staticmethod
    def _digest(spec: GrammarSpec) -> bytes:
        return hashlib.blake2b(repr((spec.kind, spec.whitespace, spec.text)).encode(), digest_size=16).digest()

    def known(self, spec: GrammarSpec) -> bool:
        """``spec`` passed validation before (cached, or approved once): :meth:`prepare` needs no sandbox job."""
        digest = self._digest(spec)
        with self._lock:
            return spec in self._cache or digest in self._approved

    def _entry(self, spec: GrammarSpec, sandbox: bool = True) -> _Entry:
        """The spec's cache entry, compiled and checked if new. ``sandbox=False`` (a spec checked before,
        on a thread that must not wait behind other specs' sandbox jobs) compiles in-process after the bounds."""
        digest = self._digest(spec)
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
                return entry
            approved = digest in self._approved
        try:
            check_bounds(spec.kind, spec.text, self.limits)
        except BoundExceeded as e:
            raise GrammarError(f"invalid {spec.kind}: {e}") from None
        ready = []
        if self.sandbox is not None and sandbox and not approved:
            try:
                checked = self.sandbox.check(spec.kind, spec.text, spec.whitespace)
            except SandboxRefused as e:
                raise GrammarError(f"invalid {spec.kind}: {e}") from None
            entry = _Entry(checked.grammar, checked.bytes)
        else:
            grammar = spec.llguidance_grammar()
            before = _heap_bytes()
            matcher = self._new_matcher(grammar)
            problem = first_mask_problem(matcher, list(self.eos_ids), self.vocab_size)
            if problem:
                raise GrammarError(f"invalid {spec.kind}: {error_line(problem)}")
            size = max(_heap_bytes() - before, 0) + len(grammar)
            if size > self.limits.max_matcher_bytes:
                raise GrammarError(
                    f"invalid {spec.kind}: its compiled form takes about {size} bytes, more than "
                    f"the limit max_matcher_bytes = {self.limits.max_matcher_bytes}"
                )
            entry, ready = _Entry(grammar, size), [matcher]
        with self._lock:
            entry = self._cache.setdefault(spec, entry)
            self._cache.move_to_end(spec)
            self._approved[digest] = None
            self._approved.move_to_end(digest)
            while len(self._approved) > 64 * self.limits.cache_entries:
                self._approved.popitem(last=False)
            self._add_ready(spec, entry, ready)
            self._evict(keep=spec)
        return entry

    def _add_ready(self, spec: GrammarSpec, entry: _Entry, matchers: list) -> int:
        """Keep ``matchers`` ready for ``spec`` while the bounds allow (lock held); how many were kept."""
        kept = 0
        for m in matchers:
            if len(entry.ready) >= self.limits.ready_per_spec:
                break
            entry.ready.append(m)
            self._evict(keep=spec)
            if sum(e.bytes for e in self._cache.values()) > self.limits.cache_bytes:
                entry.ready.pop()
                break
            kept += 1
        return kept

    def _evict(self, keep: GrammarSpec) -> None:
        """Least recently used entries out (never ``keep``) until the cache is within its bounds (lock held)."""
        total = sum(e.bytes for e in self._cache.values())
        for spec in list(self._cache):
            if len(self._cache) <= self.limits.cache_entries and total <= self.limits.cache_bytes:
                return
            if spec != keep:
                total -= self._cache.pop(spec).bytes

    def validate(self, spec: GrammarSpec) -> None:
        """Raise GrammarError if ``spec`` cannot be served; nothing to do for a spec that passed before
        (the server's event loop calls it after :meth:`prepare`: it never compiles or waits there)."""
        if not self.known(spec):
            self._entry(spec)

    def prepare(self, spec: GrammarSpec, n: int = 1) -> None:
        """Validate ``spec`` and compile up to ``n`` matchers for it ahead, first mask included, in the
        calling thread (the server's request thread): the engine thread then only takes one."""
        entry = self._entry(spec)
        while True:
            with self._lock:
                if len(entry.ready) >= min(n, self.limits.ready_per_spec):
                    return
            matcher = self._new_matcher(entry.grammar)
            if first_mask_problem(matcher, list(self.eos_ids), self.vocab_size):
                return  # it passed before: leave it to the engine's own compile
            with self._lock:
                if not self._add_ready(spec, entry, [matcher]):
                    return

    def compile(self, spec: GrammarSpec) -> "llguidance.LLMatcher":
        """A fresh matcher at the start of ``spec``, shared with nothing; raises GrammarError. It never waits
        on the sandbox (the engine thread calls it for a spec validated at submission: one the cache and
        the approved set have since dropped compiles in-process, bounds checked)."""
        entry = self._entry(spec, sandbox=False)
        with self._lock:
            if entry.ready:
                return entry.ready.pop()
        return self._new_matcher(entry.grammar)

    def processor(self, spec: GrammarSpec, stop_token_ids: Iterable[int] = ()) -> "GrammarProcessor":
        """A request's processor; ``stop_token_ids`` end it like EOS (allowed only where complete)."""
        return GrammarProcessor(self.compile(spec), self.vocab_size, set(self.eos_ids) | set(stop_token_ids))


_COMPILERS: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer) -> GrammarCompiler:
    """The shared compiler of this tokenizer object (built on first use; forgotten with the tokenizer)."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(tokenizer)
        if compiler is None:
            compiler = _COMPILERS[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


# --- the per-request processor ------------------------------------------------------------------------


class GrammarProcessor:
    """One request's grammar state, behind :class:`specdecode.processors.LogitsProcessor`.

    ``apply(logits, prefixes)``: row ``p`` of ``logits`` [P, W] is masked by the state after the
    committed tokens and ``prefixes[p]``: disallowed tokens, ids the tokenizer does not have (W may exceed
    its vocabulary), and the end tokens unless the grammar is complete there, become -inf; once the
    grammar is complete only the end tokens remain. A state where no token is allowed (a vocabulary that
    cannot spell what the grammar needs next) allows the end tokens: the output ends, incomplete,
    rather than a row of -inf making the law NaN. Prefixes are visited in sorted order sharing stems
    (a chain's nested prefixes cost one advance per token and one rollback in all; a tree's siblings
    roll back to their common ancestor). The state is unchanged afterwards.

    A *dead* prefix holds a drafted token the grammar forbids after the tokens before it (or an end
    token, or an id past the tokenizer's vocabulary): its row is returned **unmasked**. It never matters: the target's masked law gives that
    drafted token probability 0, so verification rejects it (greedy: it is not the masked argmax;
    sampled: ``u * p_draft < 0`` never holds; coupled: the target's choice is allowed) and no position
    after it is used. An all -inf row would make softmax NaN; the raw row keeps every law finite.

    Prefixes and tokens may be any integers (Python, numpy or 0-d tensors). Not thread-safe: one
    request, one thread at a time (the engine's).
    """

    def __init__(self, matcher: "llguidance.LLMatcher", vocab_size: int, end_ids: Iterable[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.end_ids = tuple(sorted(t for t in set(end_ids) if 0 <= t < vocab_size))
        self._end = set(self.end_ids)
        self._words = (vocab_size + 31) // 32
        by_byte: dict[int, int] = {}
        for t in self.end_ids:
            by_byte[t // 8] = by_byte.get(t // 8, 0) | 1 << t % 8
        self._end_bytes = (
            torch.tensor(list(by_byte), dtype=torch.long),
            torch.tensor(list(by_byte.values()), dtype=torch.uint8),
        )  # distinct bytes, their end bits
        self.ended = False  # the output ended: an end token was committed, or the engine hit a limit (incomplete)
        self.incomplete = False  # the output ended where the grammar was not complete (a dead end, a limit)
        self.limit_hit = False  # a mask at the committed state hit a limit of the engine: only end tokens remain
        self.mask_s = 0.0  # time spent in apply (the masks of target and draft rows), and the rows it masked
        self.mask_rows = 0

    @property
    def accepting(self) -> bool:
        """The committed output is complete: an end token may come now."""
        return self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but an end token can follow (or one was committed): the output is complete — or
        ``incomplete``, where the engine hit one of its limits (an error state it never leaves)."""
        return self.ended or self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """The engine's error ("" if none): a resource limit hit mid-output leaves only the end tokens."""
        return self.matcher.get_error()

    def _advance(self, tokens: Sequence[int], matcher: "llguidance.LLMatcher | None" = None) -> int:
        """Consume the longest allowed head of ``tokens`` (stopping before an end token or an id the
        tokenizer does not have: the engine would enter its error state for good); its length."""
        V = self.vocab_size
        n = next((i for i, t in enumerate(tokens) if t in self._end or not 0 <= t < V), len(tokens))
        return (matcher or self.matcher).try_consume_tokens(list(tokens[:n])) if n else 0

    def masks(self, prefixes: Prefixes) -> tuple[Tensor, list[bool], list[bool]]:
        """(bitmask [P, ceil(V / 32)] int32, the engine's own; live [P]; complete [P]: an end token may
        come there). A dead row's bitmask is all ones. The state is unchanged afterwards."""
        P = len(prefixes)
        bits = torch.full((P, self._words), -1, dtype=torch.int32)
        live, complete = [False] * P, [False] * P
        path: list[int] = []  # tokens consumed past the committed state
        rows = [[int(t) for t in prefix] for prefix in prefixes]
        # drafted tokens are walked on a copy: one that puts the engine in its error state (a limit) must not
        # end the committed output, which may never contain it
        walker = self.matcher.deep_copy() if any(rows) else self.matcher
        for p in sorted(range(P), key=lambda p: rows[p]):
            prefix = rows[p]
            common = 0
            while common < min(len(path), len(prefix)) and path[common] == prefix[common]:
                common += 1
            if len(path) > common:
                walker.rollback(len(path) - common)
                del path[common:]
            n = self._advance(prefix[common:], walker)
            path += prefix[common : common + n]
            row = bits[p]
            if len(path) == len(prefix):
                walker.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            elif not (walker.is_error() or self._allowed_at(bits, live, rows, path, prefix[len(path)])):
                continue  # dead: a forbidden drafted token
            if walker.is_error():  # the engine hit a limit on this prefix: only the end tokens (an end, incomplete)
                row.zero_()
                live[p], self.limit_hit = True, self.limit_hit or not prefix
                walker, path = self.matcher.deep_copy(), []
                continue
            live[p], complete[p] = True, walker.is_accepting()
        if path and walker is self.matcher:
            walker.rollback(len(path))
        return bits, live, complete

    @staticmethod
    def _allowed_at(bits: Tensor, live: list[bool], prefixes: list[list[int]], at: list[int], token: int) -> bool:
        """``token`` is allowed in the live row whose prefix is ``at`` (then failing to consume it is a limit
        of the engine, not a forbidden token)."""
        return any(
            live[q] and prefix == at and bool(bits.view(torch.uint8)[q, token // 8] >> token % 8 & 1)
            for q, prefix in enumerate(prefixes)
        )

    def _allows(self, token: int) -> bool:
        """The committed state's mask allows ``token`` (or cannot be computed)."""
        bits = torch.zeros(1, self._words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        return self.matcher.is_error() or self._allowed_at(bits, [True], [[]], [], token)

    def apply(self, logits: Tensor, prefixes: Prefixes) -> Tensor:
        """``logits`` [P, W] raw logits of one request -> masked copy [P, W]; the input is not written."""
        t0 = time.perf_counter()
        bits, live, complete = self.masks(prefixes)
        packed = bits.view(torch.uint8)  # [P, 4 * words]: token t is bit t % 8 of byte t // 8
        cols, flags = self._end_bytes
        packed[:, cols] &= ~flags  # the engine's end bits, replaced by ours
        stuck = ~bits.any(dim=1)  # no token can extend the output (the vocabulary cannot spell it): end, not NaN
        ends_ok = torch.tensor(complete) | stuck  # [P]
        packed[ends_ok.nonzero(), cols] |= flags
        out = torch.where(bitmask_to_bool(bits, logits.shape[1]).to(logits.device), logits, float("-inf"))
        dead = [p for p in range(len(prefixes)) if not live[p]]
        if dead:  # never used (class docstring): raw rows keep every law finite
            out[dead] = logits[dead]
        self.mask_s += time.perf_counter() - t0
        self.mask_rows += len(prefixes)
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted, in order; an end token ends the output. The output ends
        ``incomplete`` (``finished``, never an exception) at an end token where the grammar is not complete
        (the masks allow one there only where no other token could come: a dead end, or a mask the engine
        gave up on at one of its limits) or where consuming a token put the engine in its error state (a
        lexer or parser limit). Any other token the grammar does not allow raises RuntimeError, the state
        unchanged (the engine emitted a token its masked law gave probability 0: a bug)."""
        if self.ended:
            return
        tokens = [int(t) for t in tokens]
        n = self._advance(tokens)
        if n == len(tokens):
            return
        bad = tokens[n]
        if bad in self._end:  # allowed where complete, or where nothing else was (a dead end, a limit)
            self.ended = True
            self.incomplete = not self.matcher.is_accepting()
        elif self.matcher.is_error() or self._allows(bad):  # a limit of the engine, not a forbidden token
            self.ended = self.incomplete = True
        else:
            self.matcher.rollback(n)  # unchanged; a bug, not a user's error
            raise RuntimeError(f"token {bad} is not allowed by the grammar after the committed output")
