"""Part 7: logit bias, penalties, min-p and grammars under speculation follow the exactly computed law.

For each context (a prompt) and four settings — *logit bias* (T = 1; the target's most likely next token
banned with -100, its third boosted by +2), *min-p* (T = 1.3, min_p = 0.1), *penalised* (T = 1,
presence and frequency penalties -2, repetition penalty 1.3: repeating a token becomes much more likely,
so a drafted token visibly changes the law after it) and *grammar* (T = 1, a regex: the text starts with
the text of one of the target's 2nd–4th most likely next tokens, then any printable ASCII but ``<>``, so
the mask after the first token differs from the one before it) — ``samples`` seeded requests of two
tokens go through an engine drafting one token (position 0 is a drafted position, position 1 the bonus
token after it, whose law depends on the drafted token). The reference is computed teacher-forced, by a
slow loop over the history (:func:`reference_logits`), not by :mod:`specdecode.processors`; the grammar's
mask by matching every token's text against the regex with the ``regex`` module (:func:`reference_mask`),
not by llguidance:

* the first token must follow ``law_0 = warp(process(logits(ctx), generated = ()))``;
* for each of the (up to) three most likely first tokens ``a``, the second token of the requests that
  emitted ``a`` must follow ``warp(process(logits(ctx + a), generated = (a,)))``.

Chi-square goodness of fit (:func:`specdecode.check.stats.goodness_of_fit`), Bonferroni over contexts x
settings x tests at this part's share of ``alpha`` (running part 7 adds that share to the whole check's
false-alarm probability). Engines, over the same runners and drafter:

* the engine as built (must pass), and one whose drafter sees the request *without* its processors and
  min-p (must pass too: rejection sampling is exact for any proposal, only slower);
* negative controls that must fail in at least one context per setting (else NO POWER): (a) the drafter
  sees the processed request, the target does not; (b, penalised setting) each verified position
  evaluated with the penalty state of the last committed token instead of its drafted prefix (and, for the
  grammar setting, with the grammar state of the last committed token).

The part is vacuous unless tokens were drafted and accepted: it reports NO POWER if none were.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Sequence

import torch

from specdecode.check.common import EnginePool, Progress
from specdecode.check.report import FAIL, PASS, WEAK, PartResult
from specdecode.check.stats import goodness_of_fit
from specdecode.config import EngineSettings
from specdecode.engine import Engine
from specdecode.models.base import next_token_logits
from specdecode.processors import build_processors
from specdecode.sampling import SamplingParams, warp, warp_tensors

NUMBER, NAME = 7, "logits processors, min-p and grammars"
SAMPLES = 2000  # requests per (context, setting, engine)
NEUTRAL = {
    "min_p": 0.0,
    "logit_bias": (),
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "grammar": None,
}
SECOND_TOKENS = 3  # first tokens whose conditional second-token law is tested
RUST_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex::escape escapes (llguidance's syntax); Python reads it too
TAIL = "[ -;=?-~]*"  # printable ASCII but < and > (special tokens' text has them): the part after the first token


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in RUST_META else ch for ch in text)


class TokenTexts:
    """Every token's text, ``None`` for the ids the grammar never allows as text (added and special tokens, ids
    past the tokenizer), computed once per tokenizer for :func:`reference_mask`. A byte-level BPE (GPT-2,
    Qwen, Llama 3) decodes each id alone; a SentencePiece vocabulary (``▁`` for a space, ``<0xNN>`` byte
    tokens), whose decode drops a leading space, is read from its token strings instead."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        n = min(len(tokenizer), vocab_size)
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        if any(isinstance(p, str) and p.startswith("\u2581") for p in pieces):
            texts = [_piece_text(p) for p in pieces]
        else:
            texts = tokenizer.batch_decode([[i] for i in range(n)])
        self.texts = texts + [None] * (vocab_size - n)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        for i in set(added) | set(getattr(tokenizer, "all_special_ids", ())):
            if i < vocab_size:
                self.texts[i] = None


def _piece_text(piece) -> str | None:
    if not isinstance(piece, str):
        return None
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # a byte token: ASCII only
        code = int(piece[3:5], 16)
        return chr(code) if code < 128 else None
    return piece.replace("\u2581", " ")


def grammar_pattern(logits: torch.Tensor, texts: TokenTexts) -> str | None:
    """The grammar setting's regex for a context: its text starts with the text of one of the target's 2nd-4th
    most likely next tokens (printable ASCII, no ``<>``; the most likely is left out so the mask moves the law),
    then :data:`TAIL`. ``None`` when the context has no three such tokens among its 64 most likely."""
    import regex

    firsts = []
    for i in logits.argsort(descending=True)[1:64].tolist():
        text = texts.texts[i]
        if text and regex.fullmatch(TAIL, text) and text not in firsts:
            firsts.append(text)
        if len(firsts) == 3:
            return "(" + "|".join(_escape(t) for t in firsts) + ")" + TAIL
    return None


def reference_mask(pattern: str, texts: TokenTexts, generated_text: str, end_ids) -> torch.Tensor:  # [V] bool
    """The tokens a regex grammar allows after ``generated_text``: a token whose text keeps the output a prefix
    of a match (``regex`` partial matching), an end id where the output is a whole match; nothing else."""
    import regex

    compiled = regex.compile(pattern)
    allowed = torch.tensor(
        [t is not None and compiled.fullmatch(generated_text + t, partial=True) is not None for t in texts.texts]
    )
    if compiled.fullmatch(generated_text) is not None:
        allowed[[i for i in end_ids if i < len(allowed)]] = True
    return allowed


def reference_logits(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    logits: torch.Tensor,
    grammar_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # [V] -> [V]
    """The processed logits of the position after ``prompt_ids + generated``, one token at a time (the slow,
    obviously correct reference of :mod:`specdecode.processors`); ``grammar_mask`` (from
    :func:`reference_mask`) for a request with a grammar."""
    if (params.grammar is None) != (grammar_mask is None):
        raise ValueError("a grammar mask goes with a request that has a grammar, and only then")
    out = logits.double().clone()
    for tok, bias in params.logit_bias:
        out[tok] += bias
    if params.repetition_penalty != 1:
        for tok in set(prompt_ids) | set(generated):
            x = float(out[tok])
            out[tok] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for tok, count in Counter(generated).items():
        out[tok] -= params.frequency_penalty * count + params.presence_penalty
    if grammar_mask is not None:
        out[~grammar_mask] = float("-inf")
    return out.float()


def reference_law(
    params: SamplingParams, prompt_ids, generated, logits: torch.Tensor, grammar_mask: torch.Tensor | None = None
) -> torch.Tensor:  # [V]
    return warp(reference_logits(params, prompt_ids, generated, logits, grammar_mask)[None], *warp_tensors([params]))[0]


def settings(logits: torch.Tensor, texts: TokenTexts | None = None) -> dict[str, SamplingParams]:
    """The settings for a context whose target next-token logits are ``logits`` [V]; the grammar setting where
    ``texts`` are given and :func:`grammar_pattern` finds one."""
    from specdecode.grammar import GrammarSpec

    order = logits.argsort(descending=True).tolist()
    out = {
        "logit bias": SamplingParams(1.0, logit_bias=((order[0], -100.0), (order[2], 2.0))),
        "min-p": SamplingParams(1.3, min_p=0.1),
        "penalised": SamplingParams(1.0, presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=1.3),
    }
    pattern = grammar_pattern(logits, texts) if texts is not None else None
    if pattern is not None:
        out["grammar"] = SamplingParams(1.0, grammar=GrammarSpec.regex(pattern))
    return out


class _View:
    """A sequence as a drafter sees it, with other sampling parameters and processors."""

    def __init__(self, seq, params: SamplingParams, vocab_size: int, grammars=None, end_ids=()) -> None:
        self.slot, self.token_ids, self.generator = seq.slot, seq.token_ids, seq.generator
        self.params = params
        self.processors = build_processors(
            params, seq.prompt_ids, vocab_size, grammars if params.grammar is not None else None, end_ids
        )
        for proc in self.processors:
            proc.commit(seq.token_ids[len(seq.prompt_ids) :])


class DraftSees:
    """A drafter that proposes for each sequence as if its request had ``fields`` (e.g. no processors);
    ``grammars`` and ``end_ids`` (the engine's) where those fields carry a grammar."""

    def __init__(self, inner, fields: dict, vocab_size: int, grammars=None, end_ids=()) -> None:
        self.inner, self.fields, self.vocab_size = inner, fields, vocab_size
        self.grammars, self.end_ids = grammars, tuple(end_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, seqs, num_tokens):
        return self.inner.propose(
            [_View(s, replace(s.params, **self.fields), self.vocab_size, self.grammars, self.end_ids) for s in seqs],
            num_tokens,
        )


def stale_process(seqs, logits: torch.Tensor, prefixes) -> torch.Tensor:
    """Control (b): every verified position with the state of the last committed token (no drafted prefix)."""
    from specdecode.processors import process_batch

    return process_batch(seqs, logits, [[()] * len(p) for p in prefixes])


def engines(spec: Engine, params: SamplingParams) -> dict[str, tuple[Engine, SamplingParams]]:
    """The engines of one setting, each with the parameters its requests carry."""
    vocab = spec.target.vocab_size
    processed = {key: getattr(params, key) for key in NEUTRAL}

    def engine(drafter=None, verifier=None) -> Engine:
        return Engine(
            spec.target,
            spec.tokenizer,
            drafter or spec.drafter,
            1,
            EngineSettings(
                max_batch_size=spec.max_batch_size, max_context=spec.max_context, max_tree_nodes=spec.max_tree_nodes
            ),
            eos_token_ids=spec.eos_token_ids,
            verifier=verifier or spec.verifier,
        )

    grammars = spec.grammars if params.grammar is not None else None
    ends = spec.eos_token_ids

    out = {
        "engine": (engine(), params),
        "draft unprocessed": (engine(DraftSees(spec.drafter, NEUTRAL, vocab)), params),
        "control: target unprocessed": (
            engine(DraftSees(spec.drafter, processed, vocab, grammars, ends)),
            replace(params, **NEUTRAL),
        ),
    }
    stateful = (
        "grammar"
        if params.grammar is not None
        else "penalty"
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1
        else None
    )
    if stateful is not None:  # the state a drafted prefix moves: evaluated at the last committed token instead
        out[f"control: stale {stateful} state"] = (
            engine(verifier=replace(spec.verifier, process=stale_process)),
            params,
        )
    return out


def sample_pairs(
    engine: Engine, prompt: list[int], params: SamplingParams, n: int, seed: int, ignore_eos: bool = True
) -> tuple[list, dict]:
    """``n`` seeded two-token requests: their (first, second) tokens and the drafting counts. A setting with a
    grammar runs every engine's requests with ``ignore_eos=False`` (the grammar says where the output may end)."""
    pairs, drafted, accepted = [], 0, 0
    batch = engine.max_batch_size
    for lo in range(0, n, batch):
        ps = [
            replace(params, seed=seed + lo + i, max_new_tokens=2, ignore_eos=ignore_eos)
            for i in range(min(batch, n - lo))
        ]
        for out in engine.generate([prompt] * len(ps), ps):
            pairs.append(tuple(out.token_ids[:2]))
            drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    return pairs, {"drafted": drafted, "accepted": accepted}


def check_processors(
    pool: EnginePool, prompts: list[list[int]], alpha: float, progress: Progress, samples: int = SAMPLES, seed: int = 0
) -> PartResult:
    spec = pool.spec(min(16, max(1, samples)))
    if spec.drafter is None:
        raise ValueError("part 7 needs a drafter")
    texts = TokenTexts(spec.tokenizer, spec.target.vocab_size) if spec.tokenizer is not None else None
    num_tests = len(prompts) * 4 * (1 + SECOND_TOKENS)  # (at most: a context may have no grammar setting)
    level = alpha / num_tests
    progress.part(f"{NUMBER} processors and grammars", len(prompts) * 4)
    records = []
    for ci, prompt in enumerate(prompts):
        first_logits = next_token_logits(spec.target, prompt)
        for si, (name, params) in enumerate(settings(first_logits, texts).items()):
            pattern = params.grammar.text if params.grammar is not None else None

            def mask(generated: Sequence[int]):
                if pattern is None:
                    return None
                return reference_mask(pattern, texts, spec.tokenizer.decode(list(generated)), spec.eos_token_ids)

            law0 = reference_law(params, prompt, (), first_logits, mask(()))
            seconds = [a for a in law0.argsort(descending=True)[:SECOND_TOKENS].tolist() if law0[a] > 0]
            law1 = {
                a: reference_law(params, prompt, (a,), next_token_logits(spec.target, prompt + [a]), mask((a,)))
                for a in seconds
            }
            runs = {}
            for label, (engine, request) in engines(spec, params).items():
                pairs, counts = sample_pairs(
                    engine, prompt, request, samples, (seed * 100 + ci * 10 + si) * samples, ignore_eos=pattern is None
                )
                tests = [{"position": 0, **goodness_of_fit([p[0] for p in pairs], law0.numpy(), level).to_dict()}]
                for a in seconds:
                    after = [p[1] for p in pairs if p[0] == a and len(p) > 1]
                    tests.append(
                        {"position": 1, "after": a, **goodness_of_fit(after, law1[a].numpy(), level).to_dict()}
                    )
                runs[label] = {**counts, "tests": tests, "rejected": any(t["rejected"] for t in tests)}
            records.append({"context": ci, "setting": name, "runs": runs, **({"regex": pattern} if pattern else {})})
            progress.advance()
    return _verdict(records, level, samples)


def _verdict(records: list[dict], level: float, samples: int) -> PartResult:
    must_pass = ("engine", "draft unprocessed")
    failed = [
        (r["context"], r["setting"], label) for r in records for label in must_pass if r["runs"][label]["rejected"]
    ]
    controls = sorted({label for r in records for label in r["runs"] if label.startswith("control")})
    missed = [
        f"{label} ({setting})"
        for label in controls
        for setting in dict.fromkeys(r["setting"] for r in records)
        if any(label in r["runs"] for r in records if r["setting"] == setting)
        and not any(r["runs"][label]["rejected"] for r in records if r["setting"] == setting and label in r["runs"])
    ]
    accepted = sum(r["runs"]["engine"]["accepted"] for r in records)
    details = {"level_per_test": level, "samples": samples, "records": records}
    if failed:
        c, s, label = failed[0]
        return PartResult(
            NUMBER, NAME, FAIL, f"{len(failed)} runs off the processed law (first: context {c}, {s}, {label})", details
        )
    if missed or not accepted:
        why = f"controls not detected: {', '.join(missed)}" if missed else "no draft token was accepted"
        return PartResult(
            NUMBER, NAME, WEAK, f"no test rejected, but {why}: raise the samples or use other prompts", details
        )
    tests = sum(len(r["runs"]["engine"]["tests"]) for r in records)
    return PartResult(
        NUMBER,
        NAME,
        PASS,
        f"{tests} chi-square tests per engine at {level:.1e} ({samples} requests each); "
        f"the undrafted-processor run passes too; {accepted} drafts accepted; "
        f"controls detected: {', '.join(controls)}",
        details,
    )
