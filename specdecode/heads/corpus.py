"""Training text for drafter heads: files, directories and ``.jsonl``, or by default the Python
standard library of the running interpreter (real code, on every machine, no download).

A corpus is a list of :class:`Document` (a name and a way to read its text), in a fixed order, so an
interrupted extraction resumes at the same place. Benchmark prompts (HumanEval, Spec-Bench) are
never training data: :func:`documents` refuses them by name.
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdecode.errors import UserError
from specdecode.fsutil import read_jsonl

DEFAULT = "stdlib"
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".cpp", ".sh"}
SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test", ".git"}
FORBIDDEN = ("humaneval", "spec_bench", "spec-bench", "question.jsonl")  # benchmark prompts: evaluation only


class CorpusError(UserError, ValueError):
    """A corpus source that cannot be used."""


@dataclass(frozen=True)
class Document:
    name: str  # file path, or path:line for a .jsonl record
    read: Callable[[], str]  # the text (chat records rendered by the caller's template)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files_under(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if any(part in SKIP_DIRS for part in rel[:-1]) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES:
            out.append(path)
    return out


def _read_file(path: Path) -> Callable[[], str]:
    return lambda: path.read_text(encoding="utf-8", errors="replace")


def _jsonl(path: Path, render_chat: Callable[[list], str] | None) -> list[Document]:
    docs = []
    for lineno, record in read_jsonl(path, CorpusError):
        if isinstance(record.get("text"), str):
            text = record["text"]
        elif isinstance(record.get("messages"), list):
            if render_chat is None:
                raise CorpusError(f"{path}:{lineno}: chat \"messages\" need the target's chat template")
            try:
                text = render_chat(record["messages"])
            except Exception as exc:  # a malformed conversation: say where
                raise CorpusError(f"{path}:{lineno}: cannot render \"messages\" ({exc})") from None
        else:
            raise CorpusError(f"{path}:{lineno}: a record needs a string \"text\" or a list \"messages\"")
        docs.append(Document(f"{path}:{lineno}", lambda t=text: t))
    return docs


def documents(
    sources: list[str] | None, render_chat: Callable[[list], str] | None = None, seed: int = 0
) -> list[Document]:
    """The documents of ``sources`` (default: the standard library), shuffled with ``seed`` so that a
    token budget samples the whole corpus rather than its alphabetical start."""
    sources = sources or [DEFAULT]
    docs: list[Document] = []
    for source in sources:
        if any(bad in source.lower() for bad in FORBIDDEN):
            raise CorpusError(
                f"{source!r} looks like benchmark prompts (HumanEval / Spec-Bench): those are for "
                "evaluation only, never training data"
            )
        if source == DEFAULT:
            docs += [Document(str(p), _read_file(p)) for p in _files_under(_stdlib_root())]
            continue
        path = Path(source).expanduser()
        if path.is_dir():
            docs += [Document(str(p), _read_file(p)) for p in _files_under(path)]
        elif path.is_file() and path.suffix == ".jsonl":
            docs += _jsonl(path, render_chat)
        elif path.is_file():
            docs.append(Document(str(path), _read_file(path)))
        else:
            raise CorpusError(f"corpus source {source!r}: no such file or directory (or use {DEFAULT!r})")
    if not docs:
        raise CorpusError(f"corpus {sources} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))}, .jsonl)")
    random.Random(seed).shuffle(docs)
    return docs


def describe(sources: list[str] | None) -> list[str]:
    """How a manifest names the sources (the default spelled out with the interpreter's version)."""
    sources = sources or [DEFAULT]
    return [f"{DEFAULT} (Python {sys.version.split()[0]}: {_stdlib_root()})" if s == DEFAULT else s for s in sources]


def fingerprint(docs: list[Document]) -> str:
    """A hash of the document order (names), so a resumed extraction knows it reads the same corpus."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.name.encode() + b"\0")
    return h.hexdigest()[:16]
