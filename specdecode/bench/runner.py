"""The interleaved benchmark loop, its records on disk, and the greedy exactness check.

Each repeat is a pass over every prompt; for each prompt every (sampling setting, configuration)
pair runs once, in an order rotated from one (prompt, repeat) to the next, so drift of a shared machine
hits every configuration alike. Each finished run is appended to ``records.jsonl`` at once; a rerun with
the same output directory skips every (prompt, sampling, config, repeat) already there, so an interrupted
run loses at most the run in progress. Warm-up runs (each configuration once, on a short prompt) are
never recorded.

Repeats are replicates: a drafter with a cross-request history (the suffix drafter keeps finished
outputs) would otherwise draft a repeat from the same prompt's earlier output. Before each pass every
engine forgets those outputs (:meth:`specdecode.engine.Engine.forget_outputs`), so each pass sees the
history of the prompts before it in that pass, as the first did; a resumed run replays the outputs of
the runs it skips (:meth:`~specdecode.engine.Engine.remember`), so it drafts as an unbroken one would.
The selector's acceptance rates per drafter (numbers, not text) carry over from pass to pass.

Configurations: ``target`` (this engine, target only), ``spec-k<k>`` (this engine drafting k tokens),
``hf`` (``transformers`` ``generate``, target only) and ``hf-assisted`` (``generate`` with
``assistant_model=`` the draft).

Fill-in-the-middle prompts (a prompt with a ``suffix``: the ``fim`` workload) become the model's own FIM
prompt (:func:`specdecode.fim.fim_prompt`) and end as an editor's request does: at the model's FIM end
tokens (even with ``ignore_eos``, as stop tokens) and at the prompt's editor rule (``fim_stop``;
:data:`DEFAULT_FIM_STOP` when it names none), within its ``max_new_tokens`` (the ``fim`` workload caps a
completion at 32 tokens for a line, 64 for a block). The ``hf`` baselines stop at the end tokens only,
not at the editor rule: their output is checked up to the rule's cut (``past_fim_stop`` in the check
record), and their latency covers the longer output, so compare engine configurations on FIM latency.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from specdecode.bench.analysis import TARGET, first_difference, is_near_tie
from specdecode.drafters import draft_label
from specdecode.errors import UserError
from specdecode.fim import DEFAULT_FIM_STOP
from specdecode.grammar import GrammarError, GrammarSpec

if TYPE_CHECKING:
    from specdecode.sampling import SamplingSetting


class BenchInputError(UserError, ValueError):
    """Bad benchmark input (a prompt too long, an unknown setting, an incompatible resume)."""


# -- settings --------------------------------------------------------------------------------------
def bench_setting(spec: str) -> SamplingSetting:
    """A ``--sampling`` item: ``greedy`` or ``t<T>[-p<top_p>]``, e.g. ``t0.7-p0.95``, ``t1.0``, named by
    the spec itself (records and resumes match settings by that name).

    Check's ``t=<T>,k=<top-k>,p=<top-p>`` spelling is refused: ``--sampling`` is comma-separated, and the
    transformers baselines take no top-k.
    """
    from specdecode.sampling import parse_setting

    if "=" in spec:
        raise BenchInputError(
            f"unknown sampling setting {spec!r}: bench takes 'greedy' or t<T>[-p<top_p>], "
            "e.g. t0.7-p0.95 (t=,k=,p= settings are for check)"
        )
    try:
        return parse_setting(spec)
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None


@dataclass(frozen=True)
class RunConfig:
    name: str
    kind: str  # "engine" | "hf"
    k: int = 0  # draft length (engine; the depth for trees); 0 = target only
    assisted: bool = False  # hf: with the draft as assistant_model
    tree: tuple[int, int] | None = None  # engine trees: (children per expanded node, nodes per step)
    quantization: str = "none"  # engine: the draft model's quantization (configs named <name>@<mode>)
    draft: str | None = None  # engine: another drafter than --draft (--extra-draft; configs named <name>[<label>])
    auto: bool = False  # engine: --draft-policy auto over --draft and every --extra-draft (config "auto", k = its cap)
    context: int | None = None  # engine: the draft model reads this many prompt tokens (None: --draft-context)


def parse_tree_shape(spec: str) -> tuple[int, int]:
    """``TxN`` (e.g. ``2x8``): T children per expanded node, N nodes verified per step."""
    topk, sep, nodes = spec.lower().partition("x")
    try:
        shape = (int(topk), int(nodes))
    except ValueError:
        shape = None
    if not sep or shape is None or shape[0] < 2 or shape[1] < 1:
        raise BenchInputError(
            f"bad tree shape {spec!r}: use TxN with T >= 2 children per node and N >= 1 nodes, e.g. 2x8"
        )
    return shape


def parse_extra_draft(text: str, draft_lengths: list[int], shapes: list[tuple[int, int]]):
    """``SPEC[|k=K1,K2][|trees=TxN,...|none]`` -> (spec, its draft lengths, its tree shapes); options
    default to the run's ``--draft-lengths`` and ``--tree-shapes``."""
    spec, *options = text.split("|")
    ks, own_shapes = list(draft_lengths), list(shapes)
    for option in options:
        key, sep, value = option.partition("=")
        try:
            if key == "k" and sep:
                ks = [int(x) for x in value.split(",") if x]
            elif key == "trees" and sep:
                own_shapes = [] if value == "none" else [parse_tree_shape(x) for x in value.split(",") if x]
            else:
                raise ValueError
        except ValueError:
            raise BenchInputError(f"--extra-draft {text!r}: options are |k=K1,K2 and |trees=TxN,...|none") from None
    if not ks:
        raise BenchInputError(f"--extra-draft {text!r}: no draft lengths")
    return spec, ks, own_shapes


def make_configs(
    draft_lengths: list[int],
    baselines: list[str],
    tree_shapes: list[str] = (),
    quantizations: list[str] = ("none",),
    extra_drafts: list[str] = (),
    main_draft: bool = True,
    auto_k: int = 0,
    contexts: list[int] = (),
) -> list[RunConfig]:
    """target, then for each k: the main drafter (``spec-k<k>``, trees, quantizations, each bounded draft
    context of ``contexts``: ``spec-k<k>-ctx<N>``) and each extra drafter (``spec-k<k>[<label>]`` and its
    trees, at its own lengths/shapes if its spec names them), then, with ``auto_k``, the selector choosing
    among all of them (``auto``, drafts of up to ``auto_k``), then the HF baselines."""
    configs = [RunConfig(TARGET, "engine")]
    shapes = [parse_tree_shape(s) for s in tree_shapes]
    extras: list[tuple[str, str, list[int], list[tuple[int, int]]]] = []
    for text in extra_drafts:
        spec, ks, own = parse_extra_draft(text, draft_lengths, shapes)
        label = draft_label(spec)
        if label in [e[0] for e in extras]:
            label = f"{label}{len(extras) + 1}"
        extras.append((label, spec, ks, own))
    lengths = list(dict.fromkeys(list(draft_lengths) + [k for e in extras for k in e[2]]))
    for k in lengths:
        if k < 1:
            raise BenchInputError(f"draft lengths must be >= 1, got {k}")
        for q in quantizations if main_draft and k in draft_lengths else ():
            suffix = "" if q == "none" else f"@{q}"
            configs.append(RunConfig(f"spec-k{k}{suffix}", "engine", k, quantization=q))
            configs += [
                RunConfig(f"spec-k{k}-t{t}n{n}{suffix}", "engine", k, tree=(t, n), quantization=q) for t, n in shapes
            ]
            configs += [
                RunConfig(f"spec-k{k}-ctx{c}{suffix}", "engine", k, quantization=q, context=c) for c in contexts
            ]
        for label, spec, ks, own in extras:
            if k not in ks:
                continue
            configs.append(RunConfig(f"spec-k{k}[{label}]", "engine", k, draft=spec))
            configs += [RunConfig(f"spec-k{k}-t{t}n{n}[{label}]", "engine", k, tree=(t, n), draft=spec) for t, n in own]
    if auto_k:
        # the draft model in the quantization the run compares, when it compares one
        configs.append(
            RunConfig(
                "auto",
                "engine",
                auto_k,
                auto=True,
                quantization=quantizations[0] if len(quantizations) == 1 else "none",
            )
        )
    for name in baselines:
        if name not in ("hf", "hf-assisted"):
            raise BenchInputError(f"unknown baseline {name!r}: use hf, hf-assisted")
        configs.append(RunConfig(name, "hf", 0, name == "hf-assisted"))
    return configs


# a FIM prompt that names no editor rule ends at the block rule: an editor's multi-line completion, which
# ends at a line less indented than the cursor's (a column-0 cursor: at the end tokens or max_new_tokens)


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    kind: str  # "chat" | "completion"
    ids: list[int]
    max_new_tokens: int
    # more SamplingParams fields for every run of it: a FIM prompt's end tokens and editor rule
    # (specdecode.fim.stop_fields); empty otherwise
    stops: dict[str, Any] = field(default_factory=dict)
    fim_stop: str | None = None  # a FIM prompt's editor rule (recorded with its runs)
    response_format: dict[str, Any] | None = None  # a structured prompt's (json_extract): its outputs are checked
    grammar: GrammarSpec | None = None  # what the engine configs enforce (None: unconstrained, bench --no-grammar)


def tokenize_prompts(
    prompts, tokenizer, max_new_tokens: int, max_context: int, skip_too_long: bool = False, grammar: bool = True
) -> tuple[list[BenchPrompt], list[str]]:
    """Chat prompts through the chat template, completion prompts raw, FIM prompts (with a suffix) in
    the model's FIM format; check they fit the context. A prompt's ``response_format`` becomes the grammar
    its engine runs enforce (unless ``grammar`` is False: bench ``--no-grammar``); its outputs are checked
    against it either way.

    Returns the prompts and the ids of those skipped as too long (only with ``skip_too_long``).
    """
    from specdecode.fim import FimUnsupported, fim_prompt, fim_tokens, stop_fields

    out, too_long = [], []
    fim = None
    for p in prompts:
        stops, rule = {}, None
        if any(m.get("role") == "assistant" and m.get("content") is None for m in p.messages or []):
            raise BenchInputError(
                f"prompt {p.id!r} is a later chat turn: its history holds the endpoint's own earlier answer, "
                "so run chat_turns with `specdecode load` against a server (editor_replay runs here)"
            )
        if p.kind == "chat":
            ids = list(
                tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
        elif p.suffix is not None:
            try:
                fim = fim or fim_tokens(tokenizer)
            except FimUnsupported as exc:
                raise BenchInputError(f"prompt {p.id!r} is a fill-in-the-middle prompt, but {exc}") from None
            rule = p.fim_stop or DEFAULT_FIM_STOP
            ids, stops = fim_prompt(tokenizer, p.text, p.suffix, fim), stop_fields(fim, rule, p.text)
        else:
            ids = tokenizer(p.text, add_special_tokens=False).input_ids
        new = p.max_new_tokens or max_new_tokens
        if not ids:
            raise BenchInputError(f"prompt {p.id!r} is empty after tokenization")
        if len(ids) + new > max_context:
            too_long.append(f"{p.id} ({len(ids)} + {new} tokens)")
            continue
        spec = None
        if grammar and p.response_format is not None:
            try:
                spec = GrammarSpec.from_response_format(p.response_format)
            except GrammarError as exc:
                raise BenchInputError(f"prompt {p.id!r}: {exc}") from None
        out.append(BenchPrompt(p.id, p.category, p.kind, ids, new, stops, rule, p.response_format, spec))
    if too_long and not skip_too_long:
        raise BenchInputError(
            f"{len(too_long)} prompt(s) do not fit the context of {max_context} tokens (prompt + max new tokens): "
            f"{', '.join(too_long[:5])}{' ...' if len(too_long) > 5 else ''}; pass --skip-too-long to leave them out "
            f"or lower --max-new-tokens"
        )
    if not out:
        raise BenchInputError("no prompt fits the context")
    return out, too_long


def run_seed(base_seed: int, prompt_id: str, repeat: int) -> int:
    """The seed every configuration uses for this (prompt, repeat): same randomness for all."""
    digest = hashlib.sha256(f"{base_seed}:{prompt_id}:{repeat}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# -- records on disk ---------------------------------------------------------------------------------
class RecordStore:
    """``records.jsonl``: one JSON object per finished run or check, appended and flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.dropped_lines = 0
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a hard kill: that run is simply redone
                    self.dropped_lines += 1
        self._by_key: dict[tuple, dict[str, Any]] = {}  # key -> its first record
        for r in self.records:
            self._by_key.setdefault(self.key(r), r)

    @staticmethod
    def key(rec: dict[str, Any]) -> tuple:
        return (rec.get("type"), rec.get("prompt_id"), rec.get("sampling"), rec.get("config"), rec.get("repeat"))

    def has(self, kind: str, prompt_id: str, sampling: str, config: str, repeat: int) -> bool:
        return (kind, prompt_id, sampling, config, repeat) in self._by_key

    def append(self, rec: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        self.records.append(rec)
        self._by_key.setdefault(self.key(rec), rec)

    def find(self, kind: str, prompt_id: str, sampling: str, config: str, repeat: int) -> dict[str, Any] | None:
        return self._by_key.get((kind, prompt_id, sampling, config, repeat))


def check_structured(text: str, response_format: dict[str, Any]) -> dict[str, Any]:
    """Whether an output is what a ``response_format`` asks: ``json_parsed`` (it is one JSON value, after
    stripping surrounding whitespace) and ``json_valid`` (a JSON object for ``json_object``; valid against the
    schema for ``json_schema``, by ``jsonschema``; None when the schema cannot be checked)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return {"json_parsed": False, "json_valid": False}
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_parsed": True, "json_valid": isinstance(value, dict)}
    schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if schema is None:
        return {"json_parsed": True, "json_valid": None}
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return {"json_parsed": True, "json_valid": False}
    except jsonschema.SchemaError:
        return {"json_parsed": True, "json_valid": None}
    return {"json_parsed": True, "json_valid": True}


# -- one run -------------------------------------------------------------------------------------------
def run_engine(engine, prompt_ids: list[int], params) -> dict[str, Any]:
    """Drive ``engine.add/step`` for one request, timing every step.

    ``steps`` rows are ``[context_len, emitted, drafted, accepted, seconds, nodes]``, with the context
    length (prompt + generated so far) at the start of the step; ``nodes`` is the draft tokens verified
    (the tree's size; ``drafted`` is then its depth).
    """
    t0 = time.perf_counter()
    seq = engine.add(prompt_ids, params)
    steps = []
    try:
        while not seq.finished:
            ctx = len(seq.token_ids)
            ts = time.perf_counter()
            events = [ev for ev in engine.step() if ev.seq is seq]
            dt = time.perf_counter() - ts
            steps.append(
                [
                    ctx,
                    sum(len(ev.new_token_ids) for ev in events),
                    sum(ev.drafted for ev in events),
                    sum(ev.accepted for ev in events),
                    dt,
                    sum(ev.nodes for ev in events),
                ]
            )
    finally:
        if not seq.finished:
            engine.abort(seq)
    wall = time.perf_counter() - t0
    masks = [p for p in seq.processors if hasattr(p, "mask_s")]  # a grammar's: its masks' time (target and draft)
    grammar = {"mask_s": sum(p.mask_s for p in masks), "mask_rows": sum(p.mask_rows for p in masks)} if masks else {}
    why = engine.policy.explain()  # --draft-policy auto: the costs and acceptance its choices rest on
    return {
        "token_ids": seq.output_ids,
        "wall_s": wall,
        "prefill_s": seq.stats.prefill_s,
        "finish_reason": seq.finish_reason,
        "stats": seq.stats.to_dict(),
        "steps": steps,
        **grammar,
        **({"policy": why} if why else {}),
    }


# -- the loop ------------------------------------------------------------------------------------------
@dataclass
class Backend:
    """What the runner needs from the models: engines by draft length, the HF baselines, a teacher-forcing
    function for mismatch analysis, and the EOS ids."""

    engine_for: Callable[[RunConfig], Any]  # an engine config -> Engine
    hf_for: Callable[[bool], Any]  # assisted -> HFBaseline
    target_logits: Callable[[list[int]], Any]  # token ids -> [V] float logits after the last id
    eos_token_ids: list[int]
    logit_eps: float  # machine epsilon of the target's dtype, for near-tie calls
    decode: Callable[[list[int]], str] | None = None  # output ids -> text (structured prompts' outputs are checked)


def rotated(items: list, offset: int) -> list:
    if not items:
        return []
    offset %= len(items)
    return items[offset:] + items[:offset]


class BenchRunner:
    def __init__(
        self,
        backend: Backend,
        prompts: list[BenchPrompt],
        configs: list[RunConfig],
        samplings: list[SamplingSetting],
        repeats: int,
        store: RecordStore,
        seed: int = 0,
        ignore_eos: bool = True,
        warmup_tokens: int = 4,
        progress: bool = True,
        on_run: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if repeats < 1:
            raise BenchInputError(f"--repeats must be >= 1, got {repeats}")
        self.backend, self.prompts, self.configs, self.samplings = backend, prompts, configs, samplings
        self.repeats, self.store, self.seed, self.ignore_eos = repeats, store, seed, ignore_eos
        self.warmup_tokens, self.progress, self.on_run = warmup_tokens, progress, on_run
        self.runs_done = 0

    def plan(self) -> Iterator[tuple[int, BenchPrompt, int, SamplingSetting, RunConfig]]:
        """(prompt index, prompt, repeat, sampling, config): repeat by repeat, each a pass over the prompts."""
        combos = [(s, c) for s in self.samplings for c in self.configs]
        for r in range(self.repeats):
            for i, prompt in enumerate(self.prompts):
                for s, c in rotated(combos, i * self.repeats + r):
                    yield i, prompt, r, s, c

    def pending(self) -> list[tuple[int, BenchPrompt, int, SamplingSetting, RunConfig]]:
        return [t for t in self.plan() if not self.store.has("run", t[1].id, t[3].name, t[4].name, t[2])]

    def run(self) -> None:
        from tqdm import tqdm

        plan = list(self.plan())
        todo = self.pending()
        if todo and self.warmup_tokens:
            self.warmup()
        bar = tqdm(
            total=len(plan),
            initial=len(plan) - len(todo),
            desc="bench",
            unit="run",
            mininterval=2.0,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        engines = {cfg.name for cfg in self.configs if cfg.kind == "engine"}
        backlog: dict[str, list[list[int]]] = {}  # config -> skipped outputs its engine has yet to remember
        live: set[str] = set()  # configs whose engine has started this pass (forgotten, backlog remembered)
        try:
            for n, (i, prompt, r, s, c) in enumerate(plan):
                if n == 0 or plan[n - 1][2] != r:  # a new pass: every engine starts it with no outputs kept
                    backlog, live = {name: [] for name in engines}, set()
                if self.store.has("run", prompt.id, s.name, c.name, r):
                    if c.name in engines:  # skipped: its output joins the history as if it had run
                        output = self.store.find("run", prompt.id, s.name, c.name, r)["token_ids"]
                        if c.name in live:
                            self.backend.engine_for(c).remember(output)
                        else:
                            backlog[c.name].append(output)
                else:
                    if c.name in engines and c.name not in live:
                        engine = self.backend.engine_for(c)
                        engine.forget_outputs()
                        for output in backlog.pop(c.name):
                            engine.remember(output)
                        live.add(c.name)
                    bar.set_postfix_str(f"{prompt.id} {s.name} {c.name}", refresh=False)
                    rec = self.run_one(prompt, r, s, c)
                    self.store.append(rec)
                    self.runs_done += 1
                    if self.on_run:
                        self.on_run(rec)
                    bar.update(1)
                if n + 1 == len(plan) or plan[n + 1][0] != i:  # the prompt's last run of the pass: check it
                    self.check_prompt(prompt)
        finally:
            bar.close()

    def warmup(self) -> None:
        prompt = self.prompts[0]
        short = BenchPrompt(
            prompt.id, prompt.category, prompt.kind, prompt.ids[:16], self.warmup_tokens, prompt.stops, prompt.fim_stop
        )
        for s in self.samplings:
            for c in self.configs:
                self.run_one(short, 0, s, c)

    def run_one(self, prompt: BenchPrompt, repeat: int, sampling: SamplingSetting, config: RunConfig) -> dict[str, Any]:
        seed = run_seed(self.seed, prompt.id, repeat)
        eos = None if self.ignore_eos else self.backend.eos_token_ids
        end_ids = list(prompt.stops.get("stop_token_ids", ()))  # a FIM prompt's end tokens stop every config
        if end_ids:
            eos = sorted(set(eos or ()) | set(end_ids))
        if config.kind == "engine":  # a grammar says where its output ends: no ignore_eos with one
            params = sampling.params(
                seed=seed,
                max_new_tokens=prompt.max_new_tokens,
                grammar=prompt.grammar,
                ignore_eos=self.ignore_eos and prompt.grammar is None,
                **prompt.stops,
            )
            out = run_engine(self.backend.engine_for(config), prompt.ids, params)
        else:
            hf = self.backend.hf_for(config.assisted).generate(
                prompt.ids, sampling.temperature, sampling.top_p, prompt.max_new_tokens, seed, eos
            )
            out = {
                "token_ids": hf.token_ids,
                "wall_s": hf.wall_s,
                "prefill_s": None,
                "finish_reason": None,
                "stats": None,
                "steps": None,
            }
        fim = {"fim_stop": prompt.fim_stop} if prompt.fim_stop else {}
        structured = {}  # a structured prompt's: whether its grammar was on, whether the output is what it asks
        if prompt.response_format is not None and self.backend.decode is not None:
            ids = out["token_ids"]  # up to the first end token (an unconstrained run may go on past it)
            ids = ids[: next((i for i, t in enumerate(ids) if t in self.backend.eos_token_ids), len(ids))]
            structured = {"grammar": prompt.grammar is not None and config.kind == "engine"} | check_structured(
                self.backend.decode(ids), prompt.response_format
            )
        return {
            "type": "run",
            "prompt_id": prompt.id,
            "category": prompt.category,
            "prompt_kind": prompt.kind,
            **fim,
            **structured,
            "sampling": sampling.name,
            "config": config.name,
            "k": config.k,
            "repeat": repeat,
            "seed": seed,
            "prompt_tokens": len(prompt.ids),
            "new_tokens": len(out["token_ids"]),
            **out,
            "finished_at": time.time(),
        }

    # -- greedy exactness ------------------------------------------------------------------------
    def check_prompt(self, prompt: BenchPrompt) -> None:
        """Greedy: every configuration's output must equal this engine's target-only output."""
        for s in self.samplings:
            if not s.greedy:
                continue
            for r in range(self.repeats):
                base = self.store.find("run", prompt.id, s.name, TARGET, r)
                if base is None:
                    continue
                for c in self.configs:
                    run = self.store.find("run", prompt.id, s.name, c.name, r)
                    if c.name == TARGET or run is None or self.store.has("check", prompt.id, s.name, c.name, r):
                        continue
                    if prompt.grammar is not None and c.kind != "engine":
                        continue  # the transformers baselines cannot apply the grammar: nothing to compare
                    self.store.append(self.compare(prompt, s.name, c.name, r, base["token_ids"], run["token_ids"]))

    def compare(
        self, prompt: BenchPrompt, sampling: str, config: str, repeat: int, expected: list[int], got: list[int]
    ) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "type": "check",
            "prompt_id": prompt.id,
            "category": prompt.category,
            "sampling": sampling,
            "config": config,
            "repeat": repeat,
        }
        pos = first_difference(expected, got)
        rec["match"] = pos is None
        rec["first_diff"] = pos
        if pos is not None and pos == len(expected) < len(got) and prompt.fim_stop in ("line", "block"):
            # the target-only run ended at the FIM prompt's editor rule, which the hf baselines cannot apply:
            # they go on, and agreeing up to the cut is all there is to check
            rec["match"], rec["past_fim_stop"] = True, True
        if pos is None or pos >= min(len(expected), len(got)):
            return rec  # equal, or one output is a prefix of the other (an early stop)
        logits = self.backend.target_logits(prompt.ids + expected[:pos]).float()  # [V]
        top2 = logits.topk(2)
        want, have = expected[pos], got[pos]
        rec.update(
            {
                "expected_token": want,
                "got_token": have,
                "top1_token": int(top2.indices[0]),
                "top2_token": int(top2.indices[1]),
                "top2_margin": float(top2.values[0] - top2.values[1]),
                "logit_gap": float(logits[want] - logits[have]),
                "top1_logit": float(top2.values[0]),
            }
        )
        rec["near_tie"] = is_near_tie(abs(rec["logit_gap"]), rec["top1_logit"], self.backend.logit_eps)
        return rec
