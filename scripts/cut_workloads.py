#!/usr/bin/env python
"""Cut the code-completion workloads (``fim`` and ``code_edit``) from real source code shipped on PyPI.

Sources: pinned sdists of permissively licensed packages (:data:`SOURCES`), fetched from PyPI's simple
index (PEP 503) and checked against the sha256 written here; no build code runs. Never the stdlib,
HumanEval or this repository. The cut is deterministic: same sdists and seed, same files, byte for byte.

* **fim** (:func:`cut_fim`): an editor's fill-in-the-middle request. The cursor is at a line start (after
  the line's indentation, where an editor's auto-indent leaves it), mid-line (at a token boundary inside a
  line of code), or inside a block (the first body line after a line opening a block: ``:`` in Python,
  ``{`` elsewhere). The reference middle is 1-3 lines (mid-line: the rest of the line); prefix and suffix
  are whole lines around it, each 1-8k characters drawn log-uniformly, together at most
  :data:`MAX_CONTEXT_CHARS` (a 4096-token context holds them). ``fim_stop`` is the editor rule the request
  carries (``line`` for a mid-line cursor, ``block`` otherwise) and ``max_new_tokens`` its cap.
* **code_edit** (:func:`cut_code_edit`): a real Python function of 20-80 lines and one mechanical change
  whose answer mostly copies the input (rename a parameter or local, add type hints, add a docstring,
  loop to comprehension, f-strings), as one chat message. Renames carry their exact ``reference``.

Splits: by source file. Within each language the files are ordered by the sha256 of ``package/path``
and alternate dev, test, dev, ...; every prompt of a file is in its file's split, so no file's text is
in both halves.

Usage::

    python scripts/cut_workloads.py [--cache ~/.cache/specdecode/sdists] [--out specdecode/data/code_workloads]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import random
import re
import tarfile
import textwrap
import tokenize
import urllib.request
from dataclasses import dataclass
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

SEED = 41
INDEX = "https://pypi.org/simple"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Source:
    name: str
    version: str
    filename: str
    sha256: str
    license: str
    patterns: tuple[str, ...]  # files inside the sdist, relative to its top folder
    notices: tuple[str, ...]  # its license and notice files, copied into NOTICE (a source file: its header)
    note: str = ""


SOURCES = (
    Source(
        "attrs",
        "23.2.0",
        "attrs-23.2.0.tar.gz",
        "935dc3b529c262f6cf76e50877d35a4bd3c1de194fd41f47a2b7ae8f19971f30",
        "MIT",
        ("src/attr/*.py", "src/attrs/*.py"),
        ("LICENSE",),
    ),
    Source(
        "click",
        "8.1.7",
        "click-8.1.7.tar.gz",
        "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de",
        "BSD-3-Clause",
        ("src/click/*.py",),
        ("LICENSE.rst",),
    ),
    Source(
        "more-itertools",
        "10.2.0",
        "more-itertools-10.2.0.tar.gz",
        "8fccb480c43d3e99a00087634c06dd02b0d50fbf088b380de5a41a015ec239e1",
        "MIT",
        ("more_itertools/*.py",),
        ("LICENSE",),
    ),
    Source(
        "requests",
        "2.31.0",
        "requests-2.31.0.tar.gz",
        "942c5a758f98d790eaed1a29cb6eefc7ffb0d1cf7af05c3d2791656dbd6ad1e1",
        "Apache-2.0",
        ("requests/*.py",),
        ("NOTICE", "LICENSE"),
    ),
    Source(
        "simplejson",
        "3.19.2",
        "simplejson-3.19.2.tar.gz",
        "9eb442a2442ce417801c912df68e1f6ccfcd41577ae7274953ab3ad24ef7d82c",
        "MIT (dual MIT / AFL-2.1; used under MIT)",
        ("simplejson/_speedups.c",),
        ("LICENSE.txt",),
    ),
    Source(
        "MarkupSafe",
        "2.1.5",
        "MarkupSafe-2.1.5.tar.gz",
        "d283d37a890ba4c1ae73ffadf8046435c76e7bc2247bbb63c00bd1a709c6544b",
        "BSD-3-Clause",
        ("src/markupsafe/_speedups.c",),
        ("LICENSE.rst",),
    ),
    Source(
        "orjson",
        "3.10.3",
        "orjson-3.10.3.tar.gz",
        "2b166507acae7ba2f7c315dcf185a9111ad5e992ac81f2d507aac39193c2c818",
        "Apache-2.0 OR MIT (used under MIT)",
        ("src/*.rs", "src/*/*.rs", "src/*/*/*.rs", "include/yyjson/yyjson.c"),
        ("LICENSE-MIT", "include/yyjson/yyjson.c"),
        "include/yyjson/yyjson.c is yyjson by YaoYuan (MIT), vendored in the orjson sdist",
    ),
    Source(
        "Django",
        "4.2.11",
        "Django-4.2.11.tar.gz",
        "6e6ff3db2d8dd0c986b4eec8554c8e4f919b5c1ff62a5b4390c17aff2ed6e5c4",
        "BSD-3-Clause",
        ("django/contrib/admin/static/admin/js/*.js",),
        ("LICENSE",),
        "only Django's own admin scripts, not its vendor/ folder",
    ),
)

LANGUAGES = {".py": "python", ".c": "c", ".rs": "rust", ".js": "javascript"}
MIN_FILE_CHARS = 2500
SIDE_CHARS = (1000, 8000)  # prefix and suffix, each
MAX_CONTEXT_CHARS = 10000  # prefix + suffix: about 3k tokens of code, within a 4096-token context
FIM_PER_SPLIT = {"python": 10, "c": 4, "rust": 3, "javascript": 3}
FIM_MAX_NEW_TOKENS = {"line": 32, "block": 64}
CURSOR_KINDS = ("line_start", "mid_line", "block")
EDIT_PER_SPLIT = 20
EDIT_LINES = (20, 80)
MIN_GAP_LINES = 25  # two cursors of one file at least this far apart
SPLITS = ("dev", "test")


# -- sources ---------------------------------------------------------------------------------------
class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def fetch(source: Source, cache: Path) -> bytes:
    """The sdist, from the cache or PyPI's simple index; refused unless its sha256 is the pinned one."""
    path = cache / source.filename
    if not path.is_file():
        with urllib.request.urlopen(f"{INDEX}/{source.name.lower()}/", timeout=60) as page:
            parser = _Links()
            parser.feed(page.read().decode())
        urls = [h for h in parser.hrefs if h.split("#")[0].endswith("/" + source.filename)]
        if not urls:
            raise SystemExit(f"{source.filename} is not on {INDEX}/{source.name.lower()}/")
        with urllib.request.urlopen(
            urllib.request.urljoin(f"{INDEX}/{source.name.lower()}/", urls[0]), timeout=300
        ) as response:
            data = response.read()
        cache.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != source.sha256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {source.sha256}")
    return data


@dataclass(frozen=True)
class File:
    package: str
    version: str
    path: str
    language: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.package}/{self.path}"


def notices(source: Source, data: bytes) -> str:
    """The source's license and notice files, verbatim (a C file: its leading comment, which holds them)."""
    parts = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        for rel in source.notices:
            text = tar.extractfile(f"{top}/{rel}").read().decode("utf-8").replace("\r\n", "\n")
            if rel.endswith(".c"):
                text = text[: text.index("*/") + 2]
            parts.append(f"--- {rel} ---\n{text.strip()}\n")
    return "\n".join(parts)


def source_files(source: Source, data: bytes) -> list[File]:
    files = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            top, _, rel = member.name.partition("/")
            language = LANGUAGES.get(Path(rel).suffix)
            if (
                not member.isfile()
                or language is None
                or not any(fnmatch(rel, p) and rel.count("/") == p.count("/") for p in source.patterns)
            ):
                continue
            text = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
            if len(text) >= MIN_FILE_CHARS:
                files.append(File(source.name, source.version, rel, language, text))
    return files


def split_files(files: list[File]) -> dict[str, str]:
    """File key -> split: per language, ordered by sha256 of the key, alternating dev and test."""
    out = {}
    for language in sorted({f.language for f in files}):
        ordered = sorted(
            (f for f in files if f.language == language), key=lambda f: hashlib.sha256(f.key.encode()).hexdigest()
        )
        out.update({f.key: SPLITS[i % 2] for i, f in enumerate(ordered)})
    return out


# -- fim ---------------------------------------------------------------------------------------------
def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _is_code(line: str, language: str) -> bool:
    s = line.strip()
    if not s:
        return False
    comment = ("#",) if language == "python" else ("//", "/*", "*", "*/")
    return not s.startswith(comment) and not s.startswith(('"""', "'''"))


def _opens_block(line: str, language: str) -> bool:
    s = line.split("#")[0].rstrip() if language == "python" else line.split("//")[0].rstrip()
    return s.endswith(":") if language == "python" else s.endswith("{")


def _string_lines(file: File) -> set[int]:
    """0-based lines a Python multi-line string (a docstring) starts, ends or runs through."""
    if file.language != "python":
        return set()
    rows = set()
    for tok in tokenize.generate_tokens(io.StringIO(file.text).readline):
        if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
            rows.update(range(tok.start[0] - 1, tok.end[0]))
    return rows


def cursors(file: File, rng: random.Random) -> dict[str, list[tuple[int, int, int]]]:
    """Candidate ``(line, column, middle lines)`` per cursor kind (0-based line of the cursor): lines of
    code (not blank, comments or docstrings) of at most 160 characters."""
    lines = file.text.split("\n")
    strings = _string_lines(file)
    out: dict[str, list] = {k: [] for k in CURSOR_KINDS}
    for i, line in enumerate(lines):
        if not _is_code(line, file.language) or i in strings:
            continue
        n = rng.randint(1, 3)
        body = lines[i : i + n]
        if len(body) < n or any(
            not _is_code(x, file.language) or len(x) > 160 or i + j in strings for j, x in enumerate(body)
        ):
            continue
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        col = _indent(line)
        if prev and _opens_block(prev, file.language) and col > _indent(prev):
            if all(_indent(x) >= col for x in body):
                out["block"].append((i, col, n))
        elif len(line.strip()) >= 3:
            out["line_start"].append((i, col, n))
        code = line[col:]
        if len(code) >= 16:
            ends = (m.end() for m in re.finditer(r"[\w)\]]+[ .(\[,=:]+|[.(\[,] *", code))
            cuts = [e for e in ends if 4 <= e <= len(code) - 4]
            if cuts:
                out["mid_line"].append((i, col + rng.choice(cuts), 1))
    return out


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def fim_row(file: File, kind: str, line: int, col: int, n: int, rng: random.Random) -> dict | None:
    lines = file.text.split("\n")
    starts = [0]
    for x in lines:
        starts.append(starts[-1] + len(x) + 1)
    cursor = starts[line] + col
    end = starts[line + n] - 1  # the end of the middle's last line (its newline goes to the suffix)
    while True:
        want_prefix, want_suffix = _log_uniform(rng, *SIDE_CHARS), _log_uniform(rng, *SIDE_CHARS)
        if want_prefix + want_suffix <= MAX_CONTEXT_CHARS:
            break
    # whole lines: the prefix starts at a line start, the suffix ends after a newline
    first = next((s for s in starts if s >= cursor - want_prefix), cursor)
    last = max((s for s in starts if s <= end + want_suffix), default=end)
    prefix, reference, suffix = file.text[first:cursor], file.text[cursor:end], file.text[end:last]
    if min(len(prefix), len(suffix)) < SIDE_CHARS[0] or len(reference.strip()) < 4:
        return None
    rule = "line" if kind == "mid_line" else "block"
    return {
        "prefix": prefix,
        "suffix": suffix,
        "reference": reference,
        "language": file.language,
        "cursor": kind,
        "fim_stop": rule,
        "max_new_tokens": FIM_MAX_NEW_TOKENS[rule],
        "source": {"package": file.package, "version": file.version, "file": file.path, "line": line + 1},
    }


def cut_fim(files: list[File], splits: dict[str, str], seed: int) -> list[dict]:
    rows = []
    for split in SPLITS:
        for language, count in FIM_PER_SPLIT.items():
            rng = random.Random(f"{seed}:fim:{split}:{language}")
            pool = [f for f in files if f.language == language and splits[f.key] == split]
            candidates = {
                k: [(f, c) for f in pool for c in cursors(f, random.Random(f"{seed}:{f.key}"))[k]] for k in CURSOR_KINDS
            }
            taken: list[tuple[str, int]] = []
            for i in range(count):
                kind = CURSOR_KINDS[i % len(CURSOR_KINDS)]
                options = candidates[kind][:]
                rng.shuffle(options)
                for f, (line, col, n) in options:
                    if any(k == f.key and abs(line - x) < MIN_GAP_LINES for k, x in taken):
                        continue
                    row = fim_row(f, kind, line, col, n, rng)
                    if row is not None:
                        taken.append((f.key, line))
                        rows.append({"split": split, **row})
                        break
                else:
                    raise SystemExit(f"no {kind} cursor left for {language} ({split})")
    return [{"id": f"fim/{i}", "category": "fim", **row} for i, row in enumerate(rows)]


# -- code edit ---------------------------------------------------------------------------------------
RENAMES = {
    "value": "val",
    "val": "value",
    "name": "label",
    "obj": "instance",
    "func": "callback",
    "fn": "callback",
    "data": "payload",
    "result": "outcome",
    "rv": "ret",
    "items": "entries",
    "item": "entry",
    "key": "k",
    "args": "arguments",
    "kwargs": "options",
    "attrs": "attributes",
    "cls": "klass",
    "ctx": "context",
    "default": "fallback",
    "text": "content",
    "path": "location",
    "url": "address",
    "prefix": "head",
    "iterable": "source",
    "pred": "predicate",
    "n": "count",
    "i": "idx",
    "x": "elem",
    "it": "iterator",
    "s": "string",
    "params": "parameters",
    "resp": "response",
    "response": "resp",
    "request": "req",
    "headers": "header_map",
    "msg": "message",
    "message": "msg",
    "rv_value": "ret",
    "parts": "pieces",
    "kw": "keywords",
    "rest": "remainder",
    "out": "output",
    "buf": "buffer",
    "seq": "sequence",
    "param": "parameter",
    "option": "opt",
    "cmd": "command",
    "command": "cmd",
    "values": "vals",
    "callback": "handler",
    "a": "left",
    "b": "right",
    "f": "file_obj",
    "chunk": "block",
    "lines": "rows",
}

TAIL = (
    "Keep everything else exactly as it is. Answer with the complete rewritten function in a single "
    "```python code block and nothing else."
)


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _used_names(tree: ast.AST) -> set[str]:
    return {getattr(n, "id", None) or getattr(n, "arg", None) or getattr(n, "attr", None) for n in ast.walk(tree)}


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node):
        if node.id == self.old:
            node.id = self.new
        return node

    def visit_arg(self, node):
        if node.arg == self.old:
            node.arg = self.new
        return node


def rename(code: str, old: str, new: str) -> str | None:
    """``code`` with the name ``old`` (variables and parameters, not attributes, keywords, strings or
    comments) renamed ``new``; None where the positions do not check out."""
    tree = ast.parse(code)
    lines = code.split("\n")
    spots = sorted(
        {
            (n.lineno - 1, n.col_offset)
            for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id == old) or (isinstance(n, ast.arg) and n.arg == old)
        },
        reverse=True,
    )
    for row, byte_col in spots:
        raw = lines[row].encode()
        if raw[byte_col : byte_col + len(old.encode())] != old.encode():
            return None
        lines[row] = (raw[:byte_col] + new.encode() + raw[byte_col + len(old.encode()) :]).decode()
    out = "\n".join(lines)
    try:
        same = ast.dump(ast.parse(out)) == ast.dump(_Rename(old, new).visit(ast.parse(code)))
    except SyntaxError:
        return None
    return out if same else None


def edits(code: str, fn: ast.FunctionDef) -> list[dict]:
    """The changes that apply to this function: ``{"change", "instruction", "reference"?}``."""
    out = []
    used = _used_names(fn) | set(re.findall(r"\w+", code))
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
    stored = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} - set(params)
    for kind, names in (("rename_parameter", params), ("rename_variable", sorted(stored))):
        for old in names:
            new = RENAMES.get(old)
            if new and new not in used:
                ref = rename(code, old, new)
                if ref is not None:
                    what = "parameter" if kind == "rename_parameter" else "local variable"
                    out.append(
                        {
                            "change": kind,
                            "reference": ref,
                            "instruction": f"Rename the {what} `{old}` to `{new}` everywhere in the function "
                            "(leave strings and comments as they are).",
                        }
                    )
                    break
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    if params and fn.returns is None and all(a.annotation is None for a in args):
        out.append(
            {
                "change": "add_type_hints",
                "instruction": "Add type hints to every parameter (except self/cls) and to the return value.",
            }
        )
    if ast.get_docstring(fn) is None:
        out.append(
            {
                "change": "add_docstring",
                "instruction": "Add a short docstring saying what the function does, its parameters and what it "
                "returns.",
            }
        )
    for body in (n.body for n in ast.walk(fn) if hasattr(n, "body") and isinstance(n.body, list)):
        for first, second in zip(body, body[1:]):
            if (
                isinstance(first, ast.Assign)
                and len(first.targets) == 1
                and isinstance(first.targets[0], ast.Name)
                and isinstance(first.value, ast.List)
                and not first.value.elts
                and isinstance(second, ast.For)
                and not second.orelse
                and len(second.body) == 1
                and isinstance(second.body[0], ast.Expr)
                and isinstance(call := second.body[0].value, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "append"
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == first.targets[0].id
            ):
                out.append(
                    {
                        "change": "loop_to_comprehension",
                        "instruction": f"Replace the loop that fills `{first.targets[0].id}` with a list "
                        "comprehension.",
                    }
                )
                break
        else:
            continue
        break
    if any(
        (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "format"
            and isinstance(n.func.value, ast.Constant)
            and isinstance(n.func.value.value, str)
        )
        or (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Mod)
            and isinstance(n.left, ast.Constant)
            and isinstance(n.left.value, str)
        )
        for n in ast.walk(fn)
    ):
        out.append(
            {
                "change": "f_strings",
                "instruction": "Convert every `str.format` call and `%` string formatting in it to an f-string.",
            }
        )
    return out


def edit_candidates(file: File) -> list[dict]:
    lines = file.text.split("\n")
    out = []
    for fn in _functions(ast.parse(file.text)):
        first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        if not EDIT_LINES[0] <= fn.end_lineno - first + 1 <= EDIT_LINES[1]:
            continue
        code = textwrap.dedent("\n".join(lines[first - 1 : fn.end_lineno]))
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        for e in edits(code, tree.body[0]):
            out.append({"code": code, "function": fn.name, "line": first, "file": file, **e})
    return out


def cut_code_edit(files: list[File], splits: dict[str, str], seed: int) -> list[dict]:
    rows = []
    changes = (
        "rename_parameter",
        "add_type_hints",
        "rename_variable",
        "add_docstring",
        "f_strings",
        "loop_to_comprehension",
    )
    for split in SPLITS:
        rng = random.Random(f"{seed}:code_edit:{split}")
        pool = [c for f in files if f.language == "python" and splits[f.key] == split for c in edit_candidates(f)]
        taken: set[tuple[str, str]] = set()
        while sum(r["split"] == split for r in rows) < EDIT_PER_SPLIT:
            for change in changes:
                options = [c for c in pool if c["change"] == change and (c["file"].key, c["function"]) not in taken]
                if not options or sum(r["split"] == split for r in rows) >= EDIT_PER_SPLIT:
                    continue
                c = rng.choice(options)
                taken.add((c["file"].key, c["function"]))
                f = c["file"]
                content = (
                    f"Rewrite this Python function with one change: {c['instruction']} {TAIL}\n\n"
                    f"```python\n{c['code']}\n```"
                )
                rows.append(
                    {
                        "split": split,
                        "messages": [{"role": "user", "content": content}],
                        "change": change,
                        "instruction": c["instruction"],
                        "reference": c.get("reference"),
                        "language": "python",
                        "max_new_tokens": 64 + 16 * math.ceil(len(c["code"]) / 48),
                        "source": {
                            "package": f.package,
                            "version": f.version,
                            "file": f.path,
                            "line": c["line"],
                            "function": c["function"],
                        },
                    }
                )
    return [{"id": f"code_edit/{i}", "category": "code_edit", **row} for i, row in enumerate(rows)]


# -- output ------------------------------------------------------------------------------------------
NOTICE_HEAD = """\
The prompts in fim.jsonl and code_edit.jsonl quote excerpts of the source files of the packages below,
from their sdists on PyPI (pinned by version and sha256), cut by scripts/cut_workloads.py. Each excerpt
stays under its package's license, reproduced below with its copyright and notice files as the sdist
ships them. specdecode uses these prompts for evaluation only (benchmarks, load generation), never as
training data.
"""


def write(out: Path, fim: list[dict], code_edit: list[dict], seed: int, texts: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("fim", fim), ("code_edit", code_edit)):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    sources = [
        {
            "package": s.name,
            "version": s.version,
            "sdist": s.filename,
            "sha256": s.sha256,
            "license": s.license,
            "files": list(s.patterns),
            **({"note": s.note} if s.note else {}),
        }
        for s in SOURCES
    ]
    (out / "sources.json").write_text(
        json.dumps({"seed": seed, "script": "scripts/cut_workloads.py", "sources": sources}, indent=1) + "\n",
        encoding="utf-8",
    )
    blocks = [NOTICE_HEAD]
    for s in SOURCES:
        head = (
            f"{s.name} {s.version} ({s.filename}, sha256 {s.sha256})\nLicense: {s.license}\n"
            f"Files: {', '.join(s.patterns)}\n" + (f"Note: {s.note}\n" if s.note else "")
        )
        blocks.append("=" * 100 + "\n" + head + "\n" + texts[s.name])
    (out / "NOTICE").write_text("\n".join(blocks), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "specdecode" / "sdists")
    parser.add_argument("--out", type=Path, default=REPO / "specdecode" / "data" / "code_workloads")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    files, texts = [], {}
    for s in SOURCES:
        data = fetch(s, args.cache)
        files += source_files(s, data)
        texts[s.name] = notices(s, data)
    splits = split_files(files)
    fim, code_edit = cut_fim(files, splits, args.seed), cut_code_edit(files, splits, args.seed)
    write(args.out, fim, code_edit, args.seed, texts)
    for name, rows in (("fim", fim), ("code_edit", code_edit)):
        print(
            name,
            {s: sum(r["split"] == s for r in rows) for s in SPLITS},
            f"{sum(len(json.dumps(r)) for r in rows) / 1024:.0f} KiB",
        )


if __name__ == "__main__":
    main()
