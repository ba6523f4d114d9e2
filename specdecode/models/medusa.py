"""Medusa heads (Cai et al. 2024): extra decoding heads on the target's final hidden state.

Head ``j`` (0-based) reads the final normed hidden state ``h_t`` of token ``t`` and predicts token
``t + j + 2``: the target itself predicts ``t + 1`` (the pending token), so one target forward plus
these heads gives a whole draft. Each head is ``depth`` residual blocks ``x + SiLU(W x + b)``
(``W`` starts at zero, so an untrained head reads like the target's own LM head) followed by one
output layer shared by all heads, initialised from the target's LM-head rows of a *reduced draft
vocabulary* (the most frequent tokens of the training corpus; ``id_map`` maps its rows to target
ids). A token outside it is never drafted, which costs acceptance, never exactness.

Saved as ``config.json`` + ``heads.safetensors`` in one directory; ``config.json`` names the target
(sizes and a fingerprint) and keeps the held-out accuracy by head and rank, from which the static
draft tree is built (:func:`static_tree`). The directory and the checks against a target are shared
with EAGLE (:func:`save_dir`, :func:`load_dir`, :func:`check_sizes`, :func:`check_model`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdecode.errors import UserError
from specdecode.models.base import Runner

CONFIG = "config.json"
WEIGHTS = "heads.safetensors"


class HeadsError(UserError, ValueError):
    """Heads that cannot be loaded or do not fit the target."""


@dataclass
class MedusaConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab: int
    depth: int = 1  # residual blocks per head
    kind: str = "medusa"
    target: dict = field(default_factory=dict)  # spec, model_type, fingerprint (see heads.features)
    accuracy: list[list[float]] = field(default_factory=list)  # [head][rank]: P(target's top-1 == head's rank-r token)
    training: dict = field(default_factory=dict)  # what produced the weights (tokens, steps, time, settings)


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    id_map: torch.Tensor  # [draft_vocab] target ids of the draft vocabulary's rows (a buffer)

    def __init__(self, config: MedusaConfig, id_map: torch.Tensor, out_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if id_map.shape != (config.draft_vocab,):
            raise HeadsError(f"id map of {tuple(id_map.shape)} rows for a draft vocabulary of {config.draft_vocab}")
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.depth)]) for _ in range(config.num_heads)
        )
        self.out = nn.Linear(config.hidden_size, config.draft_vocab, bias=False)
        if out_weight is not None:
            self.out.weight.data.copy_(out_weight)
        self.register_buffer("id_map", id_map.to(torch.long), persistent=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., H] -> logits [..., num_heads, draft_vocab] (over draft-vocabulary rows)."""
        z = torch.stack([block(hidden) for block in self.blocks], dim=-2)
        return self.out(z)

    # -- persistence --------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        save_dir(directory, self.state_dict(), self.config, WEIGHTS)

    @classmethod
    def load(cls, directory: str | Path) -> "MedusaHeads":
        directory = Path(directory).expanduser()
        config, state = load_dir(directory, WEIGHTS, MedusaConfig, "a heads")
        heads = cls(config, state["id_map"])
        try:
            heads.load_state_dict(state)
        except RuntimeError as exc:
            raise HeadsError(
                f"{directory / WEIGHTS}: weights do not match {CONFIG} ({str(exc).splitlines()[0]})"
            ) from None
        heads.eval().requires_grad_(False)
        return heads


def save_dir(directory: str | Path, state: dict[str, torch.Tensor], config, weights: str) -> None:
    """Write a trained drafter: ``state`` to ``directory/weights`` (renamed into place) and ``config`` as JSON."""
    from safetensors.torch import save_file

    from specdecode.fsutil import make_readable

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (weights + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))
    make_readable(tmp)
    tmp.replace(directory / weights)
    (directory / CONFIG).write_text(json.dumps(asdict(config), indent=1))


# -- what every trained drafter (Medusa heads, EAGLE) shares: its directory, its checks against a target ---
def check_sizes(name: str, reads: str, config, target, where: str) -> None:
    """Refuse a drafter (``name`` "heads", reading ``reads`` "hidden states") sized for another target."""
    spec = config.target.get("spec", "?")
    if config.hidden_size != target.hidden_size:
        raise HeadsError(
            f"{name} {where}: trained on {reads} of size {config.hidden_size}, this target's are "
            f"{target.hidden_size}; trained for another model ({spec})"
        )
    if config.vocab_size != target.vocab_size:
        raise HeadsError(
            f"{name} {where}: trained over a vocabulary of {config.vocab_size}, this target has "
            f"{target.vocab_size}; trained for another model ({spec})"
        )


@torch.inference_mode()
def model_fingerprint(runner: Runner) -> list[int]:
    """The 16 tokens (fewer in a tiny vocabulary) a fixed hidden vector scores highest: the same for
    one model in any dtype or backend, different for another model. Heads are checked against it."""
    gen = torch.Generator().manual_seed(1234)
    probe = torch.randn(1, runner.hidden_size, generator=gen).to(device=runner.device, dtype=runner.dtype)
    return [int(t) for t in runner.score_hidden(probe)[0].topk(min(16, runner.vocab_size // 2)).indices.tolist()]


FINGERPRINT_OVERLAP = 0.75  # share of the probe tokens in common: two fingerprints of one model


def same_model(fingerprint: list[int], runner: Runner) -> bool:
    """Whether ``runner`` is the model ``fingerprint`` (:func:`model_fingerprint`) was taken of; an empty one passes."""
    if not fingerprint:
        return True
    return len(set(fingerprint) & set(model_fingerprint(runner))) >= FINGERPRINT_OVERLAP * len(fingerprint)


def check_model(name: str, config, id_map: torch.Tensor, target, where: str) -> None:
    """Refuse a drafter whose draft vocabulary leaves the target's, or trained for another model (its fingerprint)."""
    if int(id_map.max()) >= target.vocab_size:
        raise HeadsError(f"{name} {where}: id map names tokens outside the target's vocabulary")
    if not same_model(config.target.get("fingerprint") or [], target):
        raise HeadsError(
            f"{name} {where}: trained for another model ({config.target.get('spec', '?')}): the "
            "target's output layer differs"
        )


def require_dir(directory: Path, weights: str, kind: str, noun: str, spec: str = "") -> None:
    """Refuse a path that is not a trained drafter's directory (``noun``: "a heads"; ``spec``: a draft spec's
    prefix, "medusa:DIR: ")."""
    if not (directory / CONFIG).is_file() or not (directory / weights).is_file():
        raise HeadsError(
            f"{spec}{directory} is not {noun} directory (needs {CONFIG} and {weights}; train one with "
            f"`specdecode heads train --kind {kind}`)"
        )


def load_dir(directory: str | Path, weights: str, config_type: Any, noun: str) -> tuple:
    """Read a directory :func:`save_dir` wrote: ``(config, state)``, or a :class:`HeadsError` naming what is
    wrong. ``config_type`` (a dataclass with a ``kind``) names the kind; ``noun`` ("a heads") the directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory).expanduser()
    kind = config_type.kind
    require_dir(directory, weights, kind, noun)
    try:
        config = config_type(**json.loads((directory / CONFIG).read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise HeadsError(f"{directory / CONFIG}: not {noun} config ({exc})") from None
    if config.kind != kind:
        raise HeadsError(f"{directory}: heads of kind {config.kind!r}, not {kind}")
    try:
        state = load_file(str(directory / weights))
    except (SafetensorError, OSError) as exc:
        raise HeadsError(f"{directory / weights}: unreadable ({exc})") from None
    if "id_map" not in state:
        raise HeadsError(f"{directory / weights}: no id_map")
    return config, state


def static_tree(accuracy: list[list[float]], num_nodes: int, max_depth: int) -> tuple[list[int], list[int], list[int]]:
    """Medusa's static tree: the ``num_nodes`` candidate nodes of highest estimated reach probability.

    A node is a path of ranks ``(r_1, ..., r_d)``: head ``j``'s rank-``r_j`` token at depth ``j + 1``.
    Its probability of being reached and accepted is estimated as ``prod_j accuracy[j][r_j]``, which
    never grows along a path, so taking nodes best-first from the root's children gives the subtree
    of largest expected accepted length. Returns ``(parents, depths, ranks)`` (parents ``-1`` = root),
    nodes in best-first order, so every parent precedes its children.
    """
    import heapq

    max_depth = min(max_depth, len(accuracy))
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    if max_depth < 1 or num_nodes < 1:
        return parents, depths, ranks
    heap = [(-accuracy[0][r], -1, 0, r) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    reach = {-1: 1.0}
    while heap and len(parents) < num_nodes:
        neg_p, parent, depth, rank = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        reach[node] = -neg_p
        if depth + 1 < max_depth:
            for r in range(len(accuracy[depth + 1])):
                heapq.heappush(heap, (-(reach[node] * accuracy[depth + 1][r]), node, depth + 1, r))
    return parents, depths, ranks
