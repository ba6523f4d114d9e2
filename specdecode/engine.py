"""The decode loop: propose -> verify -> commit, for a batch of sequences with ragged acceptance.

Invariant: for every running sequence, the target's KV cache holds all of ``token_ids`` except the
last ("pending") token. One step feeds ``[pending, d_1 .. d_k]`` at positions ``len-1 .. len-1+k``,
verifies, and appends ``num_accepted + 1`` tokens; the cache is then valid for the new length minus
one, and stale entries past it are masked by position and overwritten later (rollback is free).
Target-only decoding is the same loop with ``k = 0``.

Running sequences always occupy slots ``0 .. n-1`` in order; when one finishes, the last one is
moved into its slot, so every forward addresses a contiguous block of the cache. Admitted sequences
whose prompt is still being prefilled (``prefilling``, first come first served) hold the slots right
after them, in order, so the first to finish its prefill joins the running block without a copy.

Chunked prefill (``max_num_batched_tokens``): a step first prefills a chunk of the waiting prompts —
the step's token budget minus the running sequences' verify windows — then drafts and verifies the
running batch, so a long prompt never stalls running streams for more than one chunk. With
``batched_tokens_per_seq`` set the budget grows with load (that many tokens per admitted sequence
when that is more). A prompt whose
last chunk ran takes its first decode step in the same step.

A step reads top to bottom (:meth:`Engine.step`): plan -> propose -> verify -> commit. The policy's plan
(:class:`specdecode.policy.Plan`) only decides; the drafter side
(:class:`specdecode.drafters.session.DraftSession`) owns the drafter's lifecycle over the sequences (when it
starts on each, catching up, prefilling in chunks, letting go) and does the catch-up reads a plan names, so
the engine never asks whether a drafter has started, caught up or prefilled a sequence.

The engine talks to models only through the runner interface (:mod:`specdecode.models.base`) and to
drafters only through their protocol (:mod:`specdecode.drafters.base`), by way of its ``DraftSession``; it
sizes the caches itself (context + the longest verify window), verifies with an injected
:class:`~specdecode.verify.Verifier`, and hands a drafter that asks for them the target's hidden states of
every token it caches. Every
tensor it builds lives on the target's device; random draws come from per-request CPU generators, or for
a request of the coupled sampler (``--sampler coupled``) from noise keyed by its seed and each token's
position, verified by the coupled rule (:mod:`specdecode.verify.coupled`).
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterator, cast

import torch

from specdecode.config import EngineSettings
from specdecode.drafters.base import Drafter, Proposal, TargetFeatures
from specdecode.drafters.session import DraftSession
from specdecode.drafters.state import DraftState
from specdecode.errors import UserError
from specdecode.logprobs import TokenLogprob, token_logprobs
from specdecode.metrics import SpecStats
from specdecode.models.base import Runner
from specdecode.prefix_cache import BudgetSplit, RunnerPrefixCache
from specdecode.policy import DraftPolicy, FixedPolicy, Plan
from specdecode.processors import LogitsProcessor, build_processors, chain_prefixes, tree_prefixes
from specdecode.sampling import SamplingParams, greedy_tokens, make_generator, race_noises, warp, warp_tensors
from specdecode.text import IncrementalText
from specdecode.tree import tree_layout
from specdecode.verify import Verifier
from specdecode.verify.tree import DETERMINISTIC, IID

if TYPE_CHECKING:
    from specdecode.grammar import GrammarCompiler


class RequestError(UserError, ValueError):
    """A request the engine cannot serve (empty prompt, too long, bad token ids); ``param``: the
    request field at fault (None: the prompt)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PrefillError(RuntimeError):
    """The target's prefill failed; ``seqs`` (the prompts of that call) were aborted, nothing else."""

    def __init__(self, seqs: list["Sequence"]) -> None:
        super().__init__(f"prefill failed for {len(seqs)} request(s)")
        self.seqs = seqs


@dataclass(eq=False)  # identity semantics: sequences are compared and looked up by object
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    generator: torch.Generator
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    finish_reason: str | None = None  # "stop" (EOS, stop token, string or rule) | "length" | "abort" | "error"
    stats: SpecStats = field(default_factory=SpecStats)
    draft: DraftState = field(default_factory=DraftState)  # the drafter side's record of it (DraftSession's)
    prefilled: int = 0  # prompt tokens the target has cached (all but the last once prefill is complete)
    prefill_began: float | None = None  # perf_counter at the start / end of its target prefill
    prefill_ended: float | None = None
    cache_looked_up: bool = False  # its prompt was looked up in the prefix cache (Engine.prefill)
    cancelled: bool = False  # set from any thread: the client has gone; the engine skips its work at once
    error: BaseException | None = None  # why it failed alone (finish_reason "error"; see Engine.step)
    # its logits processors (logit bias, penalties: specdecode.processors); () for plain requests
    processors: tuple[LogitsProcessor, ...] = ()
    # each generated token's log-probability (params.logprobs set; specdecode.logprobs), else None
    logprobs: list[TokenLogprob] | None = None

    @property
    def in_prefill(self) -> bool:
        return self.prefill_ended is None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepEvent:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    drafted: int = 0  # draft length (chain) or tree depth proposed for this sequence in the step
    accepted: int = 0  # draft tokens accepted
    nodes: int = 0  # draft tokens verified (= drafted for a chain)
    error: BaseException | None = None  # set: this sequence failed alone in the step (finished, no tokens)


@dataclass
class _Verified:
    """One step's verification, per row: what to emit and what the target cached."""

    tokens: list[list[int]]  # emitted tokens are tokens[b][: accepted[b] + 1]
    accepted: list[int]
    paths: list[list[int]]  # query indices of the pending token and the accepted drafts
    depths: list[int]  # draft length (chains) or depth of the tree (trees)
    nodes: list[int]  # draft tokens verified
    input_ids: torch.Tensor  # [B, Q] the forward's queries
    features: dict  # layer -> [B, Q, H] (only what the drafter asked for)
    faults: dict[int, BaseException] = field(default_factory=dict)  # rows whose sampling failed
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # rows that asked: per emitted token


@dataclass
class Output:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids (an EOS that ended the sequence is included)
    text: str  # cut before a stop string; special tokens skipped
    finish_reason: str
    stats: SpecStats
    logprobs: list[TokenLogprob] | None = None  # one per generated id, when params.logprobs is set


class Engine:
    def __init__(
        self,
        target: Runner,
        tokenizer,
        drafter: Drafter | None = None,
        policy: DraftPolicy | int = 0,
        settings: EngineSettings = EngineSettings(),
        *,
        verifier: Verifier | None = None,
        eos_token_ids: set[int] | None = None,
    ) -> None:
        """``settings``: the engine's slice of the config, checked when it was made
        (:meth:`specdecode.config.EngineConfig.engine_settings`; tests and scripts make one directly)."""
        self.target = target
        self.tokenizer = tokenizer
        self.settings = settings
        # the policy decides how many tokens to draft (a request that does not speculate is never planned)
        self.policy = FixedPolicy(policy if drafter is not None else 0) if isinstance(policy, int) else policy
        self.verifier = verifier or Verifier()
        self.sampler = settings.sampler  # a request's sampler when its params name none (--sampler)
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else default_eos_ids(target, tokenizer))
        self.device = target.device
        # the verify window: the pending token plus the longest chain or largest tree a step may carry
        max_tree_nodes = max(settings.max_tree_nodes, drafter.max_tree_nodes if drafter is not None else 0)
        self.window = max(self.policy.max_k, max_tree_nodes) + 1
        self.max_tree_nodes = max_tree_nodes  # > 0: the drafter proposes trees of up to this many nodes
        self.target_quantization = settings.target_quantization  # "int8"/"int4": a LOSSY, quantized target
        self.lossy: dict = dict(settings.lossy)  # why outputs do not follow the named target's law ({} = exact)
        self.max_batch_size = settings.max_batch_size or target.num_slots or 1
        max_context = settings.max_context
        if max_context is None:  # what the runner's cache holds beside the verify window
            if not target.max_len:
                raise ValueError("max_context is needed when the runner has no cache yet")
            max_context = target.max_len - self.window
            if max_context < 1:
                raise ValueError(
                    f"the runner's cache of {target.max_len} leaves no context beside a window of {self.window}"
                )
        self.max_context = max_context
        target.ensure_capacity(self.max_batch_size, max_context + self.window)
        if drafter is not None:
            drafter.reserve(self.max_batch_size, max_context + self.window)
        self.feature_layers = tuple(drafter.feature_layers) if drafter is not None else ()
        # True (the server, `generate`): a new sequence's first token comes from the target alone and the
        # drafter sees its prompt only after that (see add_batch), so speculation never delays it
        self.first_token_from_target = settings.first_token_from_target
        # tokens one step may carry (the verify windows of the running batch + a chunk of waiting
        # prompts); None: a prompt is prefilled whole in the step after its admission
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        # > 0: the budget grows with load, to this many tokens per admitted sequence (0: fixed budget)
        self.batched_tokens_per_seq = settings.batched_tokens_per_seq
        # the drafter's side: its lifecycle over the sequences (starts, late starts, chunked prefill, release);
        # True (the server): a drafter exception makes the rows involved decode target-only (drafters.guard)
        self.drafts = DraftSession(
            drafter,
            after_first_token=settings.first_token_from_target,
            prefill_chunk=settings.max_num_batched_tokens,
            isolate_faults=settings.isolate_drafter_faults,
        )
        # one --prefix-cache-mb for the target's cache and each draft model's (prefix_cache.BudgetSplit)
        budget = BudgetSplit(settings.prefix_cache_mb << 20, target, list(self.drafts.runners().values()))
        if settings.prefix_cache_mb:
            self.drafts.keep_prefixes(budget)
        self.drafter = self.drafts.drafter  # (inside its fault guard when isolating faults)
        # the target's KV of earlier prompts and outputs: a prompt that begins with one is prefilled from there
        # (off where the drafter reads the target's features of every prompt token: a restored prefix has none)
        self.prefix_cache: RunnerPrefixCache | None = None
        if settings.prefix_cache_mb and not self.feature_layers and RunnerPrefixCache.supported(target):
            self.prefix_cache = RunnerPrefixCache(target, budget.target)
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet fully cached; slots after the running ones
        self._ids = itertools.count()

    @property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar compiler (structured outputs: ``SamplingParams.grammar``), built on first
        use — seconds for a 150k-token vocabulary, so the server builds it at startup — and shared by every
        engine over the same tokenizer object (:func:`specdecode.grammar.compiler_for`)."""
        from specdecode.grammar import compiler_for

        return compiler_for(self.tokenizer)

    @property
    def backend(self) -> str:
        """The backend that runs the target (the runner says: ``torch``, ``llamacpp``, ...)."""
        return self.target.backend

    def where(self) -> dict[str, str]:
        """Where each model runs, by role (the target and whatever the drafter owns)."""
        return {role: runner.where for role, runner in self.runners().items()}

    def runners(self) -> dict[str, Runner]:
        """Every model runner in use, by role: ``target`` and whatever the drafter owns."""
        return {"target": self.target, **self.drafts.runners()}

    @property
    def draft_slots_used(self) -> int:
        """Slots the drafter holds state for (after a drafter fault, fewer than the running ones)."""
        return self.drafts.slots_used(self.running)

    @property
    def drafter_faults(self) -> tuple[int, int]:
        """(drafter failures, rows retried alone) absorbed so far (``isolate_drafter_faults``)."""
        return self.drafts.faults

    # -- admission ------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.target.vocab_size)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.target.vocab_size})")
        biased = [t for t, _ in params.logit_bias if t >= self.target.vocab_size]
        if biased:
            raise RequestError(
                f"logit_bias token id {biased[0]} is outside the vocabulary [0, {self.target.vocab_size})", "logit_bias"
            )
        if len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.max_context}"
            )
        if params.grammar is not None:  # GrammarError with the engine's message, before admission (then cached)
            self.grammars.validate(params.grammar)

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.running) - len(self.prefilling)

    def has_capacity(self) -> bool:
        return self.free_slots() > 0

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Admit one request (see :meth:`add_batch`)."""
        return self.add_batch([(prompt_ids, params, request_id)])[0]

    def add_batch(
        self, requests: list[tuple[list[int], SamplingParams, str | None]], checked: bool = False
    ) -> list[Sequence]:
        """Admit requests and prefill them now, whole (every prompt token but the last, which becomes
        the pending token), in one batched pass: :meth:`admit` then :meth:`prefill`."""
        seqs = self.admit(requests, checked)
        self.prefill()
        return seqs

    def admit(
        self, requests: list[tuple[list[int], SamplingParams, str | None]], checked: bool = False
    ) -> list[Sequence]:
        """Give requests free slots; their prompts wait in ``prefilling`` (first come, first served)
        until :meth:`prefill` or the next :meth:`step` caches them. Nothing is computed here. Each request is
        checked (:meth:`validate`) unless ``checked``: its caller validated it already (once per request)."""
        if not checked:
            for prompt_ids, params, *_ in requests:
                self.validate(prompt_ids, params)
        if len(requests) > self.free_slots():
            raise RuntimeError("not enough free slots: check free_slots() first")
        first = len(self.running) + len(self.prefilling)
        requests = [(prompt_ids, self._resolve(params), request_id) for prompt_ids, params, request_id in requests]
        seqs = [
            Sequence(
                request_id=request_id or f"req-{next(self._ids)}",
                prompt_ids=list(prompt_ids),
                params=params,
                slot=first + i,
                generator=make_generator(params.seed),
                text=IncrementalText(self.tokenizer, params.stop, stop_dedent=params.stop_dedent),
                token_ids=list(prompt_ids),
                processors=build_processors(
                    params,
                    prompt_ids,
                    self.target.vocab_size,
                    self.grammars if params.grammar is not None else None,
                    self.eos_token_ids,
                ),
                logprobs=None if params.logprobs is None else [],
            )
            for i, (prompt_ids, params, request_id) in enumerate(requests)
        ]
        self.prefilling.extend(seqs)
        return seqs

    def _resolve(self, params: SamplingParams) -> SamplingParams:
        """A request's params with its sampler decided (the engine's when it names none); a coupled
        request without a seed gets a random one here, which keys its noise from then on."""
        sampler = params.sampler or self.sampler
        seed = params.seed
        if sampler == "coupled" and seed is None:
            seed = secrets.randbits(63)
        if (sampler, seed) == (params.sampler, params.seed):
            return params
        return replace(params, sampler=sampler, seed=seed)

    def prefill(self, budget: int | None = None) -> list[Sequence]:
        """Prefill the target on waiting prompts in admission order, at most ``budget`` tokens in all
        (None: all of them), in one batched pass; a prompt may stop mid-way and continue at the next
        call. Those whose prompt is complete join the running batch (returned). A prompt equal to an earlier
        one in the queue, and as far along, is not computed again: its cache is copied from that one's
        (``copy_slot``; the choices of an ``n > 1`` request, or equal prompts admitted together), costing no
        budget; the drafter still prefills each. Prompts keep their queue order: a copy that is complete waits
        in ``prefilling`` until those before it are.

        The drafter side then hears of the cached prompts (:meth:`DraftSession.prompts_cached`): the drafter
        prefills them right after, unless ``first_token_from_target``: then a new sequence's first step
        drafts nothing, so its first token comes from the target alone, sampled exactly as target-only
        decoding would, and the drafter catches up on the prompt at the start of the sequence's second step
        (target features it wants are kept until then), so speculation never delays the first token."""
        if self.prefix_cache is not None:  # a new prompt starts after its longest cached prefix
            for s in self.prefilling:
                if not s.cache_looked_up:  # (once, before its first chunk)
                    s.cache_looked_up = True
                    s.prefilled = s.stats.prefill_cached = self.prefix_cache.restore(
                        s.slot, s.prompt_ids, len(s.prompt_ids) - 1
                    )
        chunks: list[tuple[Sequence, int]] = []  # (sequence, tokens this call)
        leaders: dict[tuple[int, ...], tuple[Sequence, int]] = {}  # prompt -> its first sequence and chunk
        followers: list[tuple[Sequence, Sequence, int]] = []  # (sequence, the one it copies, tokens it gains)
        left, exhausted = budget, False
        for s in self.prefilling:
            n = len(s.prompt_ids) - 1 - s.prefilled
            if n > 0 and (lead := leaders.get(tuple(s.prompt_ids))) is not None:
                gain = lead[0].prefilled + lead[1] - s.prefilled  # (an earlier equal prompt is at least as far)
                # copy the earlier one's cache; with target features for the drafter only from the same point
                if gain > 0 and (not self.feature_layers or s.prefilled == lead[0].prefilled):
                    followers.append((s, lead[0], gain))
                    chunks.append((s, gain))
                    continue
            if exhausted:
                continue  # waits for the next call (an equal prompt later in the queue may still copy)
            if left is not None:
                if left <= 0 and n > 0:
                    exhausted = True
                    continue
                n = min(n, left)
                left -= n
            chunks.append((s, n))
            if n > 0:
                leaders.setdefault(tuple(s.prompt_ids), (s, n))
        if not chunks:
            return []
        t0 = time.perf_counter()
        for s, _ in chunks:
            if s.prefill_began is None:
                s.prefill_began = t0
        copies = {id(f) for f, _, _ in followers}
        work = [(s, n) for s, n in chunks if n > 0 and id(s) not in copies]
        if work:
            pieces = [s.prompt_ids[s.prefilled : s.prefilled + n] for s, n in work]
            try:
                feats = self.target.prefill(
                    [s.slot for s, _ in work], pieces, self.feature_layers, starts=[s.prefilled for s, _ in work]
                )
            except Exception as exc:
                failed = [s for s, _ in work] + [f for f, _, _ in followers]
                for s in failed:
                    self.abort(s)
                raise PrefillError(failed) from exc
        fresh: dict[Sequence, TargetFeatures] = {}  # this call's target features for the drafter, by sequence
        if work:
            for (s, n), piece, f in zip(work, pieces, feats):
                if self.feature_layers:
                    fresh[s] = TargetFeatures(s.prefilled, piece, f)
                s.prefilled += n
        for s, source, n in followers:  # (n choices of one request, or equal prompts admitted together)
            self.target.copy_slot(source.slot, s.slot, source.prefilled)
            if self.feature_layers:
                fresh[s] = fresh[source]
            s.prefilled += n
            s.stats.prefill_copied += n
        t1 = time.perf_counter()
        for s, _ in work:
            s.stats.prefill_s += t1 - t0
        for s, _, _ in followers:
            s.stats.prefill_s += t1 - t0
        done = list(itertools.takewhile(lambda s: s.prefilled == len(s.prompt_ids) - 1, self.prefilling))
        for s in done:  # the first ones in admission order: their slots follow the running block already
            s.prefill_ended = t1
        del self.prefilling[: len(done)]
        self.running.extend(done)
        if self.prefix_cache is not None:
            for s in done:
                self.prefix_cache.save(s.slot, s.prompt_ids[:-1])
        self.drafts.cached(list(fresh), list(fresh.values()))
        self.drafts.prompts_cached(done)
        return done

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            seq.finish_reason = seq.finish_reason or "abort"
            self._release(seq)
        elif seq in self.prefilling:
            seq.finish_reason = seq.finish_reason or "abort"
            self.prefilling.remove(seq)
            self._pack_prefilling()

    def forget_outputs(self) -> None:
        """The drafter drops what it keeps of finished requests' outputs (the ``history`` capability)."""
        self.drafts.forget_outputs()

    def remember(self, output: list[int]) -> None:
        """The drafter keeps ``output`` as a finished request's (the ``history`` capability)."""
        self.drafts.remember(list(output))

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """One step: plan -> propose -> verify -> commit for every running sequence, after a chunk of the
        waiting prompts' prefill (all of them when ``max_num_batched_tokens`` is None), those just prefilled
        included (their first token comes from the target alone).

        A failure that belongs to one row (its sampling parameters, its text) fails that row alone: its
        event carries the ``error``, it emits nothing and leaves the batch; the others step on. A failure
        of the shared forward raises (the caller decides about the whole batch)."""
        seqs = self.running
        self.drafts.catch_up(seqs)  # the drafter starts where it owes a start (late, or after a chunked prefill)
        plan = self._plan(seqs)  # the policy decides; it runs nothing
        self.drafts.read_ahead(plan.reads)  # the catch-up reads the plan names, before anything is proposed
        ks = list(plan.lengths)
        if self.prefilling:
            done = self.prefill(self._chunk_budget(ks))
            ks += [0] * len(done)  # (their first token comes from the target alone)
            for s in [s for s in done if s.cancelled]:  # its client left during the prefill: no step
                i = self.running.index(s)
                ks[i] = ks[-1]  # as _release moves the last running sequence into the freed place
                ks.pop()
                self.abort(s)
        if not seqs:
            return []
        bsz = len(seqs)
        for s, k in zip(seqs, ks):
            label = self.policy.label(s, k)
            if label is not None:
                s.stats.record_choice(label)

        t0 = time.perf_counter()
        proposal = self.drafts.propose(seqs, ks)
        t1 = time.perf_counter()
        verified = (
            self._verify_tree(seqs, proposal) if proposal.parents is not None else self._verify_chain(seqs, proposal)
        )
        t2 = time.perf_counter()
        self.policy.observe_step(bsz, verified.input_ids.shape[1], t1 - t0, t2 - t1)

        events = []
        for b, seq in enumerate(seqs):
            fault = verified.faults.get(b)
            if fault is None:
                try:
                    events.append(self._commit(seq, verified, b, t1 - t0, t2 - t1))
                    continue
                except Exception as exc:  # this row's text or bookkeeping: it fails alone
                    fault = exc
            seq.finish_reason, seq.error = "error", fault
            events.append(StepEvent(seq, [], True, error=fault))
        if self.feature_layers:  # what the target cached of the live rows, for the drafter
            live = [(b, s) for b, s in enumerate(seqs) if not s.finished]
            self.drafts.cached([s for _, s in live], [self._features(verified, b, s) for b, s in live])
        for ev in events:
            if ev.finished:
                self._release(ev.seq)
        return events

    def _plan(self, seqs: list[Sequence]) -> Plan:
        """The policy's plan for the step, one length per running row. Planned are the rows the drafter may
        draft for (not one in its first step whose drafter has not seen its prompt yet, nor a request that
        does not speculate) with more than one token left; no row drafts past its token budget (a step emits
        depth + 1 tokens at most)."""
        room = [
            s.params.max_new_tokens - len(s.output_ids) - 1 if ready else 0
            for s, ready in zip(seqs, self.drafts.ready(seqs))
        ]
        planned = [s for s, r in zip(seqs, room) if r > 0]
        if not planned:
            return Plan([0] * len(seqs))
        plan = self.policy.plan(planned, len(seqs))
        ks = dict(zip(map(id, planned), plan.lengths))
        return Plan([max(0, min(ks.get(id(s), 0), r)) for s, r in zip(seqs, room)], plan.reads)

    def _commit(self, seq: Sequence, verified: "_Verified", b: int, draft_s: float, verify_s: float) -> StepEvent:
        """Row ``b``'s verified tokens into its sequence and cache."""
        a, path = verified.accepted[b], verified.paths[b]
        cached = len(seq.token_ids) - 1
        if path != list(range(a + 1)):  # a tree branch: move its K/V next to the prefix
            self.target.compact(seq.slot, [cached + q for q in path[1:]], cached + 1)
        new = self._append(seq, verified.tokens[b][: a + 1])
        if seq.logprobs is not None:
            seq.logprobs.extend(verified.logprobs[b][: len(new)])
        # the target now holds the pending token and the accepted drafts; the rest is stale
        self.target.truncate(seq.slot, cached + a + 1)
        seq.stats.record_step(verified.depths[b], a, len(new), verified.nodes[b])
        self.policy.observe(seq, verified.depths[b], a)
        seq.stats.draft_s += draft_s
        seq.stats.verify_s += verify_s
        return StepEvent(seq, new, seq.finished, verified.depths[b], a, verified.nodes[b])

    def step_token_budget(self) -> int | None:
        """Tokens this step may carry: ``max_num_batched_tokens``, or ``batched_tokens_per_seq`` per
        admitted sequence (running or prefilling) when that is more. Every running row makes a step
        dearer (its verify window, its draft), so under load a bigger chunk of waiting prompts costs
        the running streams relatively less, and a waiting prompt needs fewer of those steps. (On
        the 2-core CPU it measured worse at concurrency 16 than a fixed budget: docs/server.md; the
        server leaves it off by default.)"""
        if self.max_num_batched_tokens is None:
            return None
        admitted = len(self.running) + len(self.prefilling)
        return max(self.max_num_batched_tokens, self.batched_tokens_per_seq * admitted)

    def _chunk_budget(self, ks: list[int]) -> int | None:
        """Prompt tokens for this step: the step's budget less the running rows' verify windows, never
        below a quarter of it, so waiting prompts always progress."""
        budget = self.step_token_budget()
        if budget is None:
            return None
        return max(budget - sum(1 + k for k in ks), max(1, budget // 4))

    def _pack_prefilling(self) -> None:
        """Move the prefilling sequences down to the slots right after the running block (in order)."""
        for j, s in enumerate(self.prefilling):
            slot = len(self.running) + j
            if s.slot != slot:
                self.target.copy_slot(s.slot, slot, s.prefilled)
                s.slot = slot

    def _features(self, verified: "_Verified", b: int, seq: Sequence) -> TargetFeatures:
        """The target's hidden states of the pending token and the accepted drafts of row ``b``."""
        path = verified.paths[b]
        index = torch.tensor(path, device=self.device)
        start = len(seq.token_ids) - 1 - len(path)  # the pending token's position
        return TargetFeatures(
            start, verified.input_ids[b][path].tolist(), {layer: h[b, index] for layer, h in verified.features.items()}
        )

    def _verify_chain(self, seqs: list[Sequence], proposal: Proposal) -> "_Verified":
        bsz, dev = len(seqs), self.device
        drafts, num_draft = proposal.tokens.to(dev), proposal.num_tokens.to(dev)
        draft_probs = None if proposal.probs is None else proposal.probs.to(dev)
        k = drafts.shape[1]
        ids = torch.cat([torch.tensor([[s.token_ids[-1]] for s in seqs], device=dev), drafts], dim=1)  # [B, k+1]
        start = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=dev)
        positions = start[:, None] + torch.arange(k + 1, device=dev)[None, :]  # [B, k+1]
        out = self.target.forward(torch.arange(bsz, device=dev), ids, positions, layers=self.feature_layers)
        logits = self.target.logits(out.hidden)  # [B, k+1, V]
        if any(s.processors for s in seqs):  # position j of row b follows drafts[b, :j]
            logits = self.verifier.process(seqs, logits, [chain_prefixes(row, k + 1) for row in drafts.tolist()])
        faults: dict[int, BaseException] = {}
        if all(s.params.greedy for s in seqs):
            result = self.verifier.greedy(drafts, greedy_tokens(logits), num_draft)
        else:
            target_probs, faults = self._warp(seqs, logits)
            if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
                raise RuntimeError("draft and target distributions have different vocabulary sizes")

            def rejection(r: torch.Tensor):
                uniforms = self._uniforms([seqs[b] for b in r.tolist()], num_draft[r].tolist(), k).to(dev)
                probs = None if draft_probs is None else draft_probs[r]
                return self.verifier.speculative(drafts[r], probs, target_probs[r], num_draft[r], uniforms)

            def coupled(c: torch.Tensor):
                noise = self._noise([seqs[b] for b in c.tolist()], k + 1, target_probs.shape[-1])
                return self.verifier.coupled(drafts[c], target_probs[c], noise, num_draft[c])

            result = self._by_sampler(seqs, rejection, coupled)
        accepted, n = result.num_accepted.tolist(), num_draft.tolist()
        tokens, paths = result.tokens.tolist(), [list(range(a + 1)) for a in accepted]
        return _Verified(
            tokens,
            accepted,
            paths,
            n,
            n,
            ids,
            out.features,
            faults,
            self._logprobs(seqs, logits, tokens, paths, faults),
        )

    def _verify_tree(self, seqs: list[Sequence], proposal: Proposal) -> "_Verified":
        bsz, dev = len(seqs), self.device
        drafts, num_nodes = proposal.tokens.to(dev), proposal.num_tokens.to(dev)
        assert proposal.parents is not None  # (step verifies a proposal with parents here)
        if int(num_nodes.max()) > self.max_tree_nodes:
            assert self.drafter is not None  # (nodes were proposed: by the drafter)
            raise RuntimeError(
                f"drafter {self.drafter.name!r} proposed a tree of {int(num_nodes.max())} nodes, more "
                f"than the engine's max_tree_nodes={self.max_tree_nodes}"
            )
        parents = proposal.parents.to(dev)
        start = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=dev)
        layout = tree_layout(
            torch.tensor([s.token_ids[-1] for s in seqs], device=dev), drafts, parents, num_nodes, start
        )
        out = self.target.forward(
            torch.arange(bsz, device=dev),
            layout.input_ids,
            layout.positions,
            write_positions=layout.write_positions,
            tree_mask=layout.mask,
            layers=self.feature_layers,
        )
        logits = self.target.logits(out.hidden)  # [B, 1+K, V]
        if any(s.processors for s in seqs):  # node i (query 1 + i) follows its root-to-node path
            width = logits.shape[1]
            logits = self.verifier.process(
                seqs,
                logits,
                [
                    tree_prefixes(t, p, n, width)
                    for t, p, n in zip(drafts.tolist(), parents.tolist(), num_nodes.tolist())
                ],
            )
        faults: dict[int, BaseException] = {}
        if all(s.params.greedy for s in seqs):
            result = self.verifier.tree_greedy(drafts, parents, num_nodes, greedy_tokens(logits))
        else:
            target_probs, faults = self._warp(seqs, logits)
            draft_probs = None if proposal.probs is None else proposal.probs.to(dev)
            if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
                raise RuntimeError("draft and target distributions have different vocabulary sizes")
            rule = proposal.rule or (DETERMINISTIC if draft_probs is None else IID)

            def rejection(r: torch.Tensor):
                uniforms = self._uniforms([seqs[b] for b in r.tolist()], num_nodes[r].tolist(), drafts.shape[1]).to(dev)
                probs = None if draft_probs is None else draft_probs[r]
                return self.verifier.tree(drafts[r], parents[r], num_nodes[r], probs, target_probs[r], uniforms, rule)

            def coupled(c: torch.Tensor):
                depth = layout.depth[c]
                noise = self._noise([seqs[b] for b in c.tolist()], int(depth.max()) + 1, target_probs.shape[-1])
                return self.verifier.tree_coupled(drafts[c], parents[c], num_nodes[c], target_probs[c], noise, depth)

            result = self._by_sampler(seqs, rejection, coupled)
        accepted, tokens = result.num_accepted.tolist(), result.tokens.tolist()
        paths = [row[: a + 1] for row, a in zip(result.path.tolist(), accepted)]
        depth = (layout.depth * (torch.arange(layout.depth.shape[1], device=dev)[None] <= num_nodes[:, None])).amax(1)
        return _Verified(
            tokens,
            accepted,
            paths,
            depth.tolist(),
            num_nodes.tolist(),
            layout.input_ids,
            out.features,
            faults,
            self._logprobs(seqs, logits, tokens, paths, faults),
        )

    @staticmethod
    def _logprobs(
        seqs: list[Sequence],
        logits: torch.Tensor,
        tokens: list[list[int]],
        paths: list[list[int]],
        faults: dict[int, BaseException],
    ) -> dict[int, list[TokenLogprob]]:
        """Rows that asked for logprobs: each emitted token's, read from the target's processed logits
        ``logits`` [B, Q, V] at the query it was emitted after (``paths[b][i]`` for the i-th emitted token:
        the pending token, then each accepted draft), so no forward is added; other rows cost nothing."""
        out: dict[int, list[TokenLogprob]] = {}
        for b, s in enumerate(seqs):
            if s.params.logprobs is None or b in faults:
                continue
            path = paths[b]
            rows = logits[b, torch.tensor(path, device=logits.device)]  # [A+1, V]
            out[b] = token_logprobs(rows, tokens[b][: len(path)], s.params.temperature, s.params.logprobs)
        return out

    @staticmethod
    def _warp(seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, BaseException]]:
        """[B, Q, V] logits -> warped probabilities, and the rows whose warp raised. Batched first; if
        that raises, row by row, so one row's failure (its parameters, non-finite logits) fails that
        row alone: it gets a placeholder law (one-hot on the argmax) and is dropped after the step.
        A row's law never depends on the batch (:func:`warp` is row-wise), so the fallback is exact."""
        bsz, width = logits.shape[:2]

        def rows(params: list[SamplingParams], x: torch.Tensor) -> torch.Tensor:
            return warp(x.flatten(0, 1), *(t.repeat_interleave(width) for t in warp_tensors(params))).view(
                len(params), width, -1
            )

        try:
            return rows([s.params for s in seqs], logits), {}
        except Exception:
            pass  # find the row(s)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        faults: dict[int, BaseException] = {}
        for b, s in enumerate(seqs):
            try:
                probs[b] = rows([s.params], logits[b : b + 1])[0]
            except Exception as exc:
                faults[b] = exc
                probs[b].scatter_(1, logits[b].argmax(-1, keepdim=True), 1.0)
        return probs, faults

    def _by_sampler(self, seqs: list[Sequence], rejection, coupled):
        """Verify the coupled rows with ``coupled(rows)`` and the others with ``rejection(rows)`` (rows: a
        [n] index tensor), and put the two results together in batch order."""
        is_coupled = [s.params.coupled for s in seqs]
        groups = [
            (fn, torch.tensor([b for b, c in enumerate(is_coupled) if c == want], device=self.device))
            for fn, want in ((coupled, True), (rejection, False))
        ]
        parts = [(rows, fn(rows)) for fn, rows in groups if rows.numel()]
        if len(parts) == 1:
            return parts[0][1]
        merged = {}
        for name in parts[0][1].__dataclass_fields__:  # pad the rows' results to the wider and interleave them
            tensors = [getattr(result, name) for _, result in parts]
            shape = (len(seqs), *(max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())))
            out = torch.full(shape, -1 if name == "path" else 0, dtype=tensors[0].dtype, device=tensors[0].device)
            for (rows, _), t in zip(parts, tensors):
                where: tuple[torch.Tensor | slice, ...] = (rows.to(out.device), *(slice(0, w) for w in t.shape[1:]))
                out[where] = t
            merged[name] = out
        return type(parts[0][1])(**merged)

    def _noise(self, seqs: list[Sequence], width: int, vocab: int) -> torch.Tensor:  # [B, width, V]
        """The coupled sampler's noise of each row's positions ``len(token_ids) .. + width - 1`` (keyed by
        its seed and those positions alone: the same in any batch, on any device)."""
        # (every coupled request has a seed: _resolve gives one)
        return torch.stack([race_noises(cast(int, s.params.seed), len(s.token_ids), width, vocab) for s in seqs]).to(
            self.device
        )

    def _uniforms(self, seqs: list[Sequence], num_draft: list[int], k: int) -> torch.Tensor:
        """[B, k+1]: each row draws its own ``num_draft + 1`` uniforms from its own generator, so a
        seeded sequence's randomness does not depend on the rest of the batch (nor on the device)."""
        out = torch.zeros(len(seqs), k + 1)
        for b, (seq, n) in enumerate(zip(seqs, num_draft)):
            if seq.params.greedy:
                continue
            u = torch.rand(n + 1, generator=seq.generator)
            out[b, :n] = u[:n]
            out[b, k] = u[n]
        return out

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append verified tokens, cutting exactly at EOS (or a request's ``stop_token_ids``: kept in
        ``token_ids``, never in the text), a stop string, the block rule, a complete grammar (nothing but an
        end token could follow: the request ends without it, wherever the step boundaries fall) or the length
        limit. Each appended token advances the request's processors."""
        new = []
        for tok in tokens:
            seq.token_ids.append(tok)
            new.append(tok)
            for proc in seq.processors:
                proc.commit([tok])
            if (
                (tok in self.eos_token_ids and not seq.params.ignore_eos)
                or tok in seq.params.stop_token_ids
                or seq.text.add(tok)  # (the text hears every token up to a stop: only here, in this order)
                or (seq.processors and any(getattr(p, "finished", False) for p in seq.processors))
            ):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens or len(seq.token_ids) >= self.max_context:
                seq.finish_reason = "length"
            if seq.finished:
                break
        return new

    def _release(self, seq: Sequence) -> None:
        if self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.save(seq.slot, seq.token_ids[:-1])  # the prompt and its output: a chat's next turn
        i = self.running.index(seq)
        last = self.running.pop()
        self.policy.forget(seq)
        self.drafts.release(seq)
        if last is not seq:  # keep slots contiguous: move the last sequence into the freed slot
            self.target.copy_slot(last.slot, i, len(last.token_ids) - 1)
            self.drafts.move(last, i)
            last.slot = i
            self.running[i] = last
        self._pack_prefilling()

    # -- convenience ----------------------------------------------------------------------------
    def stream(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> Iterator[StepEvent]:
        """Run prompts to completion (admitting new ones as slots free up), yielding step events."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        for p, sp in zip(prompts, params_list):
            self.validate(p, sp)
        queue: list[tuple[list[int], SamplingParams, str | None]] = [
            (p, sp, str(i)) for i, (p, sp) in enumerate(zip(prompts, params_list))
        ]
        while queue or self.running or self.prefilling:
            if queue and self.free_slots():
                admit, queue = queue[: self.free_slots()], queue[self.free_slots() :]
                # whole prompts now, or (chunked prefill) a chunk per step from the next step on
                (self.add_batch if self.max_num_batched_tokens is None else self.admit)(admit)
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[Output]:
        done: dict[str, Output] = {}
        for ev in self.stream(prompts, params):
            if ev.error is not None:
                raise RuntimeError(f"request {ev.seq.request_id} failed") from ev.error
            if ev.finished:
                s = ev.seq
                assert s.finish_reason is not None  # (a finished sequence's event: ev.finished is s.finished)
                done[s.request_id] = Output(
                    s.request_id, s.prompt_ids, s.output_ids, s.text.finish(), s.finish_reason, s.stats, s.logprobs
                )
        return [done[str(i)] for i in range(len(prompts))]


def default_eos_ids(target: Runner, tokenizer) -> set[int]:
    """The target's generation-config EOS ids and the tokenizer's."""
    ids = set(target.eos_token_ids)
    source = getattr(tokenizer, "eos_token_id", None)
    if isinstance(source, int):
        ids.add(source)
    elif source:
        ids.update(int(x) for x in source)
    return ids
