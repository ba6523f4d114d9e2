"""Sampling parameters and settings, and the one place where logits become (warped) probabilities.

Draft and target distributions are both produced by :func:`warp`, so speculative sampling compares
like with like: the output follows the *warped* target distribution exactly.

Warping order (same as Hugging Face's logits warpers): temperature, then top-k, then top-p, then min-p.
A request's logits processors (logit bias, penalties: :mod:`specdecode.processors`) change the raw
logits before all of them.
Greedy (``temperature == 0``) is represented as a one-hot distribution on the argmax (first index
on ties), which makes greedy decoding a special case of the exact speculative rule. A temperature
below :data:`GREEDY_TEMPERATURE` is greedy too (dividing logits by a subnormal number overflows to
NaN probabilities). No NaN reaches sampling: :func:`warp` raises instead.

Finite by range. Every numeric parameter has a closed range (:data:`_RANGES`; docs/server.md's limits table),
checked here once for the library, the command line and the server (a :class:`SamplingError` names the field).
Inside the ranges a processed, scaled logit is at most ``(2 (|x| + 100) + 2 (n + 1)) / 1e-5`` in magnitude for
a model logit ``x`` after ``n`` generated tokens (bias, repetition ratio, penalties, temperature): finite in
float32 for any ``|x|`` below 1e33, so a model's logits never become NaN probabilities or non-finite logprobs.

Two samplers (``SamplingParams.sampler``, ``--sampler``): ``rejection`` (the default) draws each
request's randomness from its generator, in the order the engine consumes it, so a seeded request's
tokens depend on what was drafted; ``coupled`` samples every position by the Gumbel-max trick, in
its exponential-race form ``argmax(probs / E)`` with ``E ~ Exp(1)`` per token, the noise ``E`` keyed
by (seed, absolute position) alone (:func:`race_noise`). The drafter proposes with the same noise on
its own law and the target accepts a draft token iff its own choice is that token
(:mod:`specdecode.verify.coupled`), so the output is target-only coupled decoding's, token for token.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from specdecode.errors import UserError
from specdecode.logprobs import LOGPROBS_MAX
from specdecode.text import MAX_STOP_CHARS

if TYPE_CHECKING:
    from specdecode.grammar import GrammarSpec


# temperatures below this are greedy (vLLM's convention: its _SAMPLING_EPS); logits / 1e-40 are NaN
GREEDY_TEMPERATURE = 1e-5
# any top-k of at least the vocabulary keeps every token; larger values are clamped here so that a
# huge integer (2**63) never overflows a tensor
TOP_K_MAX = 2**31 - 1
TOP_P_MIN = float(torch.finfo(torch.float32).tiny)  # ~1.2e-38; see params_tensors
TEMPERATURE_MAX = 2.0  # OpenAI's range of temperature: [0, 2]
LOGIT_BIAS_MAX = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]
PENALTY_MAX = 2.0  # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]
# repetition_penalty divides or multiplies a seen token's logit by at most a factor of 2 either way: 2 is the
# largest penalty, 1/2 its mirror image (rewarding repetition as strongly). A ratio near 0 is what turned finite
# logits into inf (x / 1e-39 overflows float32): no ratio in range can (see "Finite by range" below)
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.5, 2.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
SAMPLERS = ("rejection", "coupled")  # --sampler; see the module docstring


class SamplingError(UserError, ValueError):
    """Impossible sampling arguments; ``param`` names the field (the server's 400 names it too)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NonFiniteProbabilities(RuntimeError):
    """Warping produced NaN probabilities (non-finite logits): the row cannot be sampled."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # token ids that end the request like EOS (not in the text, finish_reason "stop"), even with
    # ignore_eos (vLLM's convention): e.g. a fill-in-the-middle prompt's end tokens (specdecode.fim)
    stop_token_ids: tuple[int, ...] = ()
    # end the text at the first line, after the first, indented less than this many columns (tabs to
    # multiples of 8), or at the blank lines before it: an editor's block rule (specdecode.fim); None = off
    stop_dedent: int | None = None
    # "rejection" | "coupled" (SAMPLERS); None: the engine's (--sampler). Greedy requests ignore it
    sampler: str | None = None
    # keep a token iff its probability (after temperature, top-k and top-p) is >= min_p x the largest; 0 = off
    min_p: float = 0.0
    # (token id, bias) pairs added to the raw logits (OpenAI's logit_bias; a dict is accepted and sorted)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the generated tokens
    # vLLM / Hugging Face's: over prompt + generated tokens, a positive logit divided, a negative multiplied; 1 = off
    repetition_penalty: float = 1.0
    # the output must match this JSON schema, regex or grammar (specdecode.grammar: the engine masks every
    # position's law with it, the drafters' too); None = free text. Not with ignore_eos: the grammar says where
    # the output ends
    grammar: GrammarSpec | None = None
    # report each emitted token's log-probability and this many top entries (0..20; specdecode.logprobs has
    # the law); None: none computed (a request that asks for none costs nothing)
    logprobs: int | None = None
    # False: decode this request with the target alone (its drafter never sees it; the law is the same either
    # way, only the speed differs): the server's ``"speculation": false`` or ``--no-speculation``
    speculation: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.speculation, bool):
            raise SamplingError(f"speculation must be true or false, got {self.speculation!r}", "speculation")
        if self._number("temperature", lambda v: 0 <= v <= TEMPERATURE_MAX) < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", "top_k")
        self._number("top_p", lambda v: 0 < v <= 1)
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got {m!r}", "max_new_tokens")
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX
        ):
            raise SamplingError(f"seed must be an integer that fits in 64 bits, got {seed!r}", "seed")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise SamplingError("stop strings must be non-empty strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise SamplingError(f"stop strings may have at most {MAX_STOP_CHARS} characters", "stop")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise SamplingError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        d = self.stop_dedent
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise SamplingError(f"stop_dedent must be an integer >= 0 or None, got {d!r}", "stop_dedent")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise SamplingError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}", "sampler")
        self._check_processing()
        self._check_grammar()
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= LOGPROBS_MAX):
            raise SamplingError(f"logprobs must be an integer in [0, {LOGPROBS_MAX}] or None, got {n!r}", "logprobs")

    def _number(self, name: str, ok) -> float:
        """The field ``name`` as a float, refused (naming the field and its range) unless a finite number ``ok``."""
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise SamplingError(f"{name} must be {_RANGES[name]}, got {v!r}", name)
        object.__setattr__(self, name, float(v))
        return float(v)

    def _check_processing(self) -> None:
        """min_p, logit_bias and the penalties (:data:`_RANGES`; the vocabulary is the engine's to check)."""
        self._number("min_p", lambda v: 0 <= v <= 1)
        self._number("presence_penalty", lambda v: -PENALTY_MAX <= v <= PENALTY_MAX)
        self._number("frequency_penalty", lambda v: -PENALTY_MAX <= v <= PENALTY_MAX)
        self._number("repetition_penalty", lambda v: REPETITION_PENALTY_MIN <= v <= REPETITION_PENALTY_MAX)
        bias = self.logit_bias
        pairs = sorted(bias.items()) if isinstance(bias, dict) else list(bias)
        out = {}
        for pair in pairs:
            tok, value = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise SamplingError(f"logit_bias keys must be token ids (integers >= 0), got {pair!r}", "logit_bias")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or abs(value) > LOGIT_BIAS_MAX
            ):
                raise SamplingError(
                    f"logit_bias values must be {_RANGES['logit_bias']}, got {value!r} for token {tok}", "logit_bias"
                )
            if tok in out:
                raise SamplingError(f"logit_bias names token {tok} twice", "logit_bias")
            out[tok] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(out.items())))

    def _check_grammar(self) -> None:
        if self.grammar is None:
            return
        from specdecode.grammar import GrammarSpec

        if not isinstance(self.grammar, GrammarSpec):
            raise SamplingError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}", "grammar")
        if self.ignore_eos:  # the grammar allows an end token exactly where the output is complete
            raise SamplingError(
                "ignore_eos cannot be combined with a grammar (response_format, regex or grammar): "
                "a structured output ends where the grammar is complete",
                "ignore_eos",
            )

    @property
    def processed(self) -> bool:
        """Whether raw logits are changed before warping (logit bias, a penalty): :mod:`specdecode.processors`."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        """Sampled by the coupled sampler (a greedy request is plain argmax whatever its sampler)."""
        return self.sampler == "coupled" and not self.greedy


# each numeric field's range, as its error message says it (docs/server.md's limits table lists the same)
_RANGES = {
    "temperature": f"a number in [0, {TEMPERATURE_MAX:g}] (0 = greedy)",
    "top_p": "a number in (0, 1] (1 = off)",
    "min_p": "a number in [0, 1] (0 = off)",
    "presence_penalty": f"a number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]",
    "frequency_penalty": f"a number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]",
    "repetition_penalty": f"a number in [{REPETITION_PENALTY_MIN:g}, {REPETITION_PENALTY_MAX:g}] (1 = off)",
    "logit_bias": f"numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]",
}


@dataclass(frozen=True)
class SamplingSetting:
    """A sampling law without the per-request parts: what ``specdecode check`` tests and
    ``specdecode bench`` runs (temperature 0 = greedy).

    ``label``, when given, is the setting's name (bench names a setting by its spec, e.g.
    ``t0.7-p0.95``, and its records are keyed by that name); otherwise the name is derived from
    the fields, e.g. ``greedy`` or ``T=0.7 top-p=0.9``.
    """

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    label: str | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        self.params()  # validates temperature, top_k, top_p and min_p
        if self.label is not None and (not isinstance(self.label, str) or not self.label):
            raise SamplingError(f"label must be a non-empty string or None, got {self.label!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def name(self) -> str:
        if self.label is not None:
            return self.label
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k={self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p={self.top_p:g}")
        if self.min_p > 0:
            parts.append(f"min-p={self.min_p:g}")
        return " ".join(parts)

    def params(self, **kw) -> SamplingParams:
        """Per-request parameters under this law (``seed``, ``max_new_tokens``, ... from ``kw``)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, **kw)


_BENCH_SPEC = re.compile(r"t(?P<t>\d+(?:\.\d+)?)(?:-p(?P<p>\d*\.?\d+))?(?:-minp(?P<m>\d*\.?\d+))?")


def parse_setting(spec: str) -> SamplingSetting:
    """One sampling setting, in either spelling:

    * ``greedy``;
    * ``t<T>[-p<top_p>][-minp<min_p>]`` (bench style), e.g. ``t0.7-p0.95``, ``t1.0``, ``t1.0-minp0.05``:
      T > 0; the setting is named by the spec itself;
    * ``t=<T>,k=<top-k>,p=<top-p>,minp=<min-p>`` (check style; any subset, in any order, t defaults to
      1), e.g. ``t=0.7,p=0.9``, ``k=20``: named from its fields (``T=0.7 top-p=0.9``).

    A spec with ``=`` is check style. Bad specs raise :class:`SamplingError` (a ``ValueError``).
    """
    spec = spec.strip()
    if spec.lower() == "greedy":
        return SamplingSetting(0.0)
    if "=" in spec:
        kw = {"t": 1.0, "k": 0, "p": 1.0, "minp": 0.0}
        for pair in spec.split(","):
            key, sep, value = pair.partition("=")
            key = key.strip().lower()
            if not sep or key not in kw:
                raise SamplingError(f"bad setting {spec!r}: use 'greedy' or t=<temp>,k=<top-k>,p=<top-p>,minp=<min-p>")
            try:
                kw[key] = int(value) if key == "k" else float(value)
            except ValueError:
                raise SamplingError(f"bad setting {spec!r}: {key}={value.strip()!r} is not a number") from None
        return SamplingSetting(kw["t"], int(kw["k"]), kw["p"], min_p=kw["minp"])
    m = _BENCH_SPEC.fullmatch(spec)
    if not m:
        raise SamplingError(
            f"unknown sampling setting {spec!r}: use 'greedy', t<T>[-p<top_p>] (e.g. t0.7-p0.95) "
            "or t=<temp>,k=<top-k>,p=<top-p> (e.g. t=0.7,p=0.9)"
        )
    t, p = float(m["t"]), float(m["p"]) if m["p"] else 1.0
    min_p = float(m["m"]) if m["m"] else 0.0
    if t <= 0 or not 0 < p <= 1 or not 0 <= min_p <= 1:
        raise SamplingError(
            f"sampling setting {spec!r}: need T > 0 (use 'greedy' for T = 0), 0 < top_p <= 1 and 0 <= min_p <= 1"
        )
    return SamplingSetting(t, 0, p, label=spec, min_p=min_p)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request CPU generator; an unseeded request gets fresh OS entropy.

    Random numbers are always drawn on the CPU (then moved to the model's device), so a seeded
    request gives the same draws on every device and whatever else is in the batch."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def warp(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] float, 1 = off
    min_p: torch.Tensor | None = None,  # [N] float, 0 = off; None: off for every row
) -> torch.Tensor:  # [N, V] float32 probabilities, rows sum to 1
    logits = logits.float()
    temperature, top_k, top_p = (x.to(logits.device) for x in (temperature, top_k, top_p))
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]

    if bool((top_k > 0).any()):
        vocab = scaled.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = torch.topk(scaled, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [N, 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)  # ties with the k-th value are kept

    rows = (top_p < 1).nonzero().flatten()
    if rows.numel():
        sub = scaled[rows]
        scaled[rows] = sub.masked_fill(sub < top_p_threshold(sub, top_p[rows]), -math.inf)

    if min_p is not None and bool((min_p > 0).any()):
        # min-p last (Hugging Face's order): keep p >= min_p * p_max, i.e. a scaled logit >= the row's largest
        # + log(min_p). The ratio p / p_max does not change when top-k or top-p drop other tokens (the
        # largest is always kept), so min-p commutes with top-k; after top-p it is a plain intersection
        min_p = min_p.to(logits.device)
        floor = scaled.amax(-1, keepdim=True) + torch.log(min_p)[:, None]  # log(0) = -inf: off
        scaled = scaled.masked_fill(scaled < floor, -math.inf)

    probs = scaled.softmax(-1)
    # NaN or infinite logits of a sampled row: never sample from them (a greedy row takes the argmax
    # below, as it does when a batch is all greedy and is never warped)
    if bool(probs.isnan().any(-1).logical_and(~greedy).any()):
        raise NonFiniteProbabilities("warped probabilities hold NaN (non-finite logits)")
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


# Candidates tried before sorting the whole vocabulary: a nucleus almost always lies in the top 64 (a
# top-k of 64 costs ~0.3 ms on a 152k vocabulary, a full sort ~15 ms). The result never depends on the
# rung that decides it (prefix sums of the same sorted values are the same numbers), so a row's law is
# a function of that row alone, in any batch.
TOP_P_LADDER = (64, 1024)


def top_p_threshold(
    scaled: torch.Tensor, top_p: torch.Tensor, ladder: tuple[int, ...] = TOP_P_LADDER
) -> torch.Tensor:  # [R, V], [R] -> [R, 1]
    """The smallest logit kept by nucleus sampling, per row: a token is kept iff the probability mass of
    the tokens *strictly* more likely than it is below ``top_p`` (tokens tied with a kept one are kept;
    no order among equal logits matters). ``ladder=()`` is the reference: one full sort."""
    vocab = scaled.shape[-1]
    lse = torch.logsumexp(scaled, -1, keepdim=True)
    threshold = torch.empty(scaled.shape[0], 1, dtype=scaled.dtype, device=scaled.device)
    pending = torch.arange(scaled.shape[0], device=scaled.device)
    for k in (*(k for k in ladder if k < vocab), vocab):
        sub = scaled[pending]
        vals = torch.sort(sub, -1, descending=True).values if k == vocab else torch.topk(sub, k, -1).values
        probs = (vals - lse[pending]).exp()
        before = probs.cumsum(-1) - probs  # mass of the candidates ahead in sorted order
        pos = torch.arange(k, device=vals.device).expand_as(vals)
        starts = torch.ones_like(vals, dtype=torch.bool)
        starts[:, 1:] = vals[:, 1:] != vals[:, :-1]
        group_start = torch.where(starts, pos, 0).cummax(-1).values
        drop = before.gather(1, group_start) >= top_p[pending][:, None]  # a sorted prefix is kept
        decided = drop.any(-1) if k < vocab else torch.ones_like(drop[:, 0])
        kept = (~drop).sum(-1, keepdim=True)  # >= 1: nothing is ahead of the first, and top_p > 0
        threshold[pending[decided]] = vals.gather(1, kept - 1)[decided]
        pending = pending[~decided]
        if not pending.numel():
            break
    return threshold


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...] long
    """``logits.argmax(-1)``, the same indices (the first of equal maxima; a NaN counts as the largest), taken
    by numpy for float32 CPU tensors: its vectorised row argmax is several times faster than torch's
    reduction over a long last dimension, and it runs on the calling thread (a greedy step then wakes no
    intra-op threads beside the backend's own)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel() and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(-1)).long()
    return logits.argmax(-1)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: ``probs`` [N, V] (need not be normalised), ``uniforms`` [N] in [0, 1).

    Tokens of zero probability are never returned. All randomness comes from ``uniforms``, which the
    caller draws from per-request generators.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = uniforms.to(probs.device, torch.float64)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)


def warp_tensors(params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature [N], top_k [N], top_p [N][, min_p [N]]) tensors for :func:`warp`; ``min_p`` only
    when a row has one (a law without min-p calls ``warp`` exactly as before it existed)."""
    if not any(p.min_p for p in params):
        return params_tensors(params)
    return (
        *params_tensors([replace(p, min_p=0.0) for p in params]),
        torch.tensor([p.min_p for p in params], dtype=torch.float32),
    )


def params_tensors(params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [N], top_k [N], top_p [N]) tensors for :func:`warp`, for laws without min-p
    (refused here, never dropped silently: :func:`warp_tensors` carries it)."""
    if any(p.min_p for p in params):
        raise SamplingError("params_tensors has no min_p: use warp_tensors")
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([min(p.top_k, TOP_K_MAX) for p in params], dtype=torch.long),
        # a top_p below float32's range would round to 0 (no nucleus at all); any top_p up to 1 / vocabulary
        # keeps exactly the most likely token(s), so the smallest normal float32 is the same law
        torch.tensor([max(p.top_p, TOP_P_MIN) for p in params], dtype=torch.float32),
    )


# -- the coupled sampler's noise ------------------------------------------------------------------
NOISE_CACHE_BYTES = 128 << 20  # recent noise rows kept (the drafter and the verifier read the same ones)
_noise_cache: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
_noise_bytes = 0
_noise_lock = threading.Lock()


def coupling_key(seed: int, position: int) -> int:
    """The generator seed of (request seed, absolute position): a hash, the same on every platform."""
    data = int(seed).to_bytes(16, "little", signed=True) + int(position).to_bytes(8, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def race_noise(seed: int, position: int, vocab: int) -> torch.Tensor:  # [V] float32 on the CPU, read-only
    """``E ~ Exp(1)`` per token for the token at ``position`` (its index in prompt + output) of a request
    seeded ``seed``: a function of (seed, position, vocab) alone, whatever the device, batch or drafter.

    Drawn as ``-log(u)`` from float64 uniforms of a CPU generator seeded by :func:`coupling_key`, then
    rounded to float32 (``argmax(probs / E)`` is then ``argmax(log probs + G)`` with Gumbel ``G = -log E``:
    Gumbel-max, an exact sample of ``probs``). Rows are cached (``NOISE_CACHE_BYTES``); never write to one."""
    global _noise_bytes
    key = (int(seed), int(position), int(vocab))
    with _noise_lock:
        row = _noise_cache.get(key)
        if row is not None:
            _noise_cache.move_to_end(key)
            return row
    g = torch.Generator()
    g.manual_seed(coupling_key(seed, position))
    row = torch.rand(vocab, dtype=torch.float64, generator=g).log_().neg_().float()
    with _noise_lock:
        if key not in _noise_cache:
            _noise_cache[key] = row
            _noise_bytes += row.numel() * row.element_size()
            while _noise_bytes > NOISE_CACHE_BYTES and len(_noise_cache) > 1:
                _, old = _noise_cache.popitem(last=False)
                _noise_bytes -= old.numel() * old.element_size()
    return row


def race_noises(seed: int, start: int, n: int, vocab: int) -> torch.Tensor:  # [n, V] float32 on the CPU
    """:func:`race_noise` of positions ``start .. start + n - 1``."""
    if n == 0:
        return torch.zeros(0, vocab)
    return torch.stack([race_noise(seed, start + i, vocab) for i in range(n)])


def coupled_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # [..., V], [..., V] -> [...] long
    """The coupled sample of each row: ``argmax(probs / noise)`` (first index on a tie). A division and a
    maximum, both exact in floating point, so a row's choice does not depend on the batch or its shape;
    tokens of probability 0 are never chosen."""
    return (probs.float() / noise.to(probs.device)).argmax(-1)
