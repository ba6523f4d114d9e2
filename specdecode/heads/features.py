"""Target features for training drafter heads: extraction (resumable) and reading.

``extract`` runs the target over a corpus in chunks of ``seq_len`` tokens and stores, for every
token, its id, its document and chunk, the requested hidden-state layers (bfloat16) and the top-k of
the target's next-token distribution there (soft labels, free from the same forward). Shards are
safetensors files of whole chunks; ``manifest.json`` names the target, the corpus, the settings,
each shard's sha256, and the cursor (document, token offset) where the next shard starts. A shard
is written to a temporary file and renamed before the manifest that names it is replaced, so a kill
at any moment loses at most the shard in progress, and a rerun continues from the cursor.

Memory is bounded by one shard (``shard_tokens`` rows) plus one chunk's logits in slices.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specdecode.errors import UserError
from specdecode.fsutil import make_readable
from specdecode.heads.corpus import Document
from specdecode.models.base import FINAL, Runner
from specdecode.models.medusa import model_fingerprint

FORMAT = 1
MANIFEST = "manifest.json"
LOGIT_ROWS = 128  # rows of vocabulary-sized logits held at once


class FeatureError(UserError, ValueError):
    """Features that cannot be used: missing, corrupted, or from another target."""


def layer_key(layer: int) -> str:
    return "final" if layer == FINAL else f"layer{layer}"


def parse_layers(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """``final`` or ``-1`` -> FINAL; integers are decoder-layer outputs (0 = embeddings)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in ("final", str(FINAL)):
            out.append(FINAL)
            continue
        try:
            layer = int(part)
        except ValueError:
            raise ValueError(f"feature layer {part!r}: use final or an integer 0..num_layers") from None
        if layer < 0 or (num_layers is not None and layer > num_layers):
            raise ValueError(f"feature layer {layer} outside 0..{num_layers if num_layers is not None else 'L'}")
        out.append(layer)
    if not out:
        raise ValueError("no feature layers given")
    return tuple(dict.fromkeys(out))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@dataclass
class ExtractSettings:
    layers: tuple[int, ...] = (FINAL,)
    seq_len: int = 512
    max_tokens: int = 50_000
    topk: int = 8
    shard_tokens: int = 8192
    max_doc_tokens: int = 4096  # tokens taken from one document at most (keeps a budget diverse)
    min_chunk: int = 32  # a document's tail shorter than this is dropped


def _tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def extract(
    runner: Runner,
    tokenizer,
    docs: Sequence[Document],
    out: Path,
    settings: ExtractSettings,
    meta: dict,
    corpus_fingerprint: str,
    progress: bool = True,
) -> dict:
    """Extract (or continue extracting) features into ``out``; returns the manifest."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()
    wanted = {
        "format": FORMAT,
        "target": meta,
        "fingerprint": model_fingerprint(runner),
        "corpus_fingerprint": corpus_fingerprint,
        "layers": [layer_key(x) for x in settings.layers],
        "seq_len": settings.seq_len,
        "topk": settings.topk,
        "max_doc_tokens": settings.max_doc_tokens,
        "hidden_size": runner.hidden_size,
        "vocab_size": runner.vocab_size,
    }
    path = out / MANIFEST
    if path.exists():
        manifest = json.loads(path.read_text())
        for key, value in wanted.items():
            if key != "target" and manifest.get(key) != value:
                raise FeatureError(
                    f"{out} holds features of another extraction ({key}: {manifest.get(key)!r} here, "
                    f"{value!r} asked); use another --out"
                )
        for shard in manifest["shards"]:
            if not (out / shard["file"]).is_file():
                raise FeatureError(f"{out}: shard {shard['file']} named in the manifest is missing")
    else:
        manifest = {**wanted, "shards": [], "tokens": 0, "cursor": [0, 0], "complete": False}
    manifest["max_tokens"] = settings.max_tokens
    if manifest["tokens"] >= settings.max_tokens or (manifest["complete"] and manifest["cursor"][0] >= len(docs)):
        manifest["complete"] = True
        _write_json(path, manifest)
        return manifest

    capture = tuple(dict.fromkeys(settings.layers + (FINAL,)))
    runner.ensure_capacity(1, settings.seq_len)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=settings.max_tokens, initial=manifest["tokens"], unit="tok", desc="extract", dynamic_ncols=True
        )
    buffer: list[dict[str, torch.Tensor]] = []
    buffered = 0
    doc_i, offset = manifest["cursor"]
    chunk_id = sum(s["chunks"] for s in manifest["shards"])

    def flush(cursor: tuple[int, int]) -> None:
        nonlocal buffer, buffered
        if not buffer:
            return
        tensors = {key: torch.cat([b[key] for b in buffer]).contiguous() for key in buffer[0]}
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file(tensors, str(tmp))
        make_readable(tmp)
        os.replace(tmp, out / name)
        manifest["shards"].append(
            {"file": name, "tokens": buffered, "chunks": len(buffer), "sha256": _sha256(out / name)}
        )
        manifest["tokens"] += buffered
        manifest["cursor"] = list(cursor)
        _write_json(path, manifest)
        buffer, buffered = [], 0

    try:
        while doc_i < len(docs) and manifest["tokens"] + buffered < settings.max_tokens:
            ids = _tokenize(tokenizer, docs[doc_i].read())[: settings.max_doc_tokens]
            while offset < len(ids) and manifest["tokens"] + buffered < settings.max_tokens:
                piece = ids[offset : offset + settings.seq_len]
                piece = piece[: settings.max_tokens - manifest["tokens"] - buffered]
                offset += settings.seq_len
                if len(piece) < settings.min_chunk:
                    continue
                buffer.append(_chunk_features(runner, piece, capture, settings, doc_i, chunk_id))
                chunk_id += 1
                buffered += len(piece)
                if bar is not None:
                    bar.update(len(piece))
                if buffered >= settings.shard_tokens:
                    flush((doc_i, offset) if offset < len(ids) else (doc_i + 1, 0))
            doc_i, offset = doc_i + 1, 0
        flush((doc_i, offset))
    finally:
        if bar is not None:
            bar.close()
    manifest["complete"] = True
    _write_json(path, manifest)
    return manifest


@torch.inference_mode()
def _chunk_features(
    runner: Runner, piece: list[int], capture: tuple[int, ...], settings: ExtractSettings, doc: int, chunk: int
) -> dict[str, torch.Tensor]:
    feats = runner.prefill([0], [piece], layers=capture)[0]
    runner.truncate(0, 0)
    n = len(piece)
    top_ids = torch.empty(n, settings.topk, dtype=torch.int32)
    top_logp = torch.empty(n, settings.topk, dtype=torch.float16)
    for lo in range(0, n, LOGIT_ROWS):
        logp = torch.log_softmax(runner.logits(feats[FINAL][lo : lo + LOGIT_ROWS]), dim=-1)
        values, indices = logp.topk(settings.topk, dim=-1)
        top_ids[lo : lo + LOGIT_ROWS] = indices.to(torch.int32).cpu()
        top_logp[lo : lo + LOGIT_ROWS] = values.clamp(min=-60).to(torch.float16).cpu()
    row = {
        "input_ids": torch.tensor(piece, dtype=torch.int32),
        "doc": torch.full((n,), doc, dtype=torch.int32),
        "chunk": torch.full((n,), chunk, dtype=torch.int32),
        "topk_ids": top_ids,
        "topk_logp": top_logp,
    }
    for layer in settings.layers:
        row[layer_key(layer)] = feats[layer].to(torch.bfloat16).cpu()
    return row


class FeatureSet:
    """All shards of an extraction, concatenated in memory (features stay bfloat16)."""

    def __init__(self, directory: str | Path, verify: bool = True) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise FeatureError(f"{self.dir}: no {MANIFEST} (run `specdecode heads extract --out {self.dir}` first)")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise FeatureError(f"{path}: corrupted manifest ({exc.msg})") from None
        if self.manifest.get("format") != FORMAT:
            raise FeatureError(f"{path}: feature format {self.manifest.get('format')!r}, expected {FORMAT}")
        if not self.manifest["shards"]:
            raise FeatureError(f"{self.dir}: the extraction holds no tokens yet")
        parts: list[dict[str, torch.Tensor]] = []
        for shard in self.manifest["shards"]:
            file = self.dir / shard["file"]
            if not file.is_file():
                raise FeatureError(f"{file}: shard missing")
            if verify and _sha256(file) != shard["sha256"]:
                raise FeatureError(
                    f"{file}: corrupted shard (sha256 differs from the manifest); delete it and its "
                    "manifest entries, or extract again"
                )
            try:
                parts.append(load_file(str(file)))
            except (SafetensorError, OSError) as exc:
                raise FeatureError(f"{file}: unreadable shard ({exc})") from None
        self.tensors = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        self.layers = [k for k in self.manifest["layers"]]
        self.hidden_size = int(self.manifest["hidden_size"])
        self.vocab_size = int(self.manifest["vocab_size"])

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].numel())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]
