"""What a backend is: a declarative row of what it supports, a way to load a model, runners made from it.

A :class:`Backend` answers three questions, and nothing above it asks anything else:

* **Can you serve this?** :meth:`Backend.refuses` reads a :class:`Request` (the settings that decide it:
  target, device, dtype, quantizations, batch invariance, whether a drafter reads intermediate layers)
  against the backend's :class:`Supports` row and says why not in the user's terms, or None.
  ``--backend auto`` asks each registered backend in turn (``specdecode.models.backends``).
* **Load this.** :meth:`Backend.load` gives a :class:`Model`: the weights and the tokenizer, loaded once.
* **Run it.** :meth:`Model.runner` makes a :class:`~specdecode.models.base.Runner` over those weights,
  one per engine (``check`` and ``bench`` build several engines over one load, each with its own cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.errors import UserError

if TYPE_CHECKING:
    import torch

    from specdecode.models.base import Runner


class BackendRefused(UserError, ValueError):
    """A backend asked for by name that cannot serve the settings (or is not installed here)."""


@dataclass(frozen=True)
class Supports:
    """One backend's row of the capability table (``specdecode models backends`` prints them all)."""

    opens: tuple[str, ...]  # what a model spec may name (specdecode.models.loading.resolve's kinds: dir, gguf, hub)
    opens_text: str  # the same for people, singular: "a .gguf file"
    devices: tuple[str, ...]  # device types: cpu, cuda
    dtypes: bool  # honours --dtype (False: computes in the file's own types)
    quantizes: tuple[str, ...] = ()  # draft quantization modes it applies to a model it loads
    target_quantizations: tuple[str, ...] = ()  # LOSSY target quantizations it applies (besides none)
    draft_modes: tuple[str, ...] = ()  # draft quantizations a pair whose target runs here may use (besides none)
    batch_invariant: bool = False  # can compute every row alike whatever the batch (--batch-invariant on)
    trees: bool = True  # verifies and grows trees of candidates
    features: bool = False  # intermediate hidden layers and input embeddings (what EAGLE drafters read)
    transformers: bool = False  # a transformers module behind its models (bench's `generate` baselines)
    auto: bool = True  # --backend auto may choose it

    def rows(self) -> dict[str, str]:
        """The row as text, for the table."""
        yes = {True: "yes", False: "no"}
        return {
            "opens": self.opens_text,
            "devices": ", ".join(self.devices),
            "--dtype": yes[self.dtypes],
            "draft quantization": ", ".join(self.quantizes) or "-",
            "target quantization": ", ".join(self.target_quantizations) or "-",
            "batch invariant": yes[self.batch_invariant],
            "trees": yes[self.trees],
            "features (EAGLE)": yes[self.features],
            "auto": yes[self.auto],
        }


@dataclass(frozen=True)
class Request:
    """The settings that decide whether a backend can run the target (and whatever drafts beside it)."""

    target: str
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the backend decides) or a torch dtype name
    target_quantization: str = "none"
    draft_modes: frozenset[str] = frozenset()  # quantization modes of the draft models ("none" left out)
    batch_invariant: str = "auto"  # auto | on | off
    features: bool = False  # a drafter reads intermediate layers or feeds input embeddings (EAGLE)
    trees: bool = False


@dataclass(frozen=True)
class Settings:
    """How to load one model: resolved once from the flags by ``specdecode.build``."""

    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    quantization: str = "none"  # the target's (LOSSY) or the draft's mode
    role: str = "target"  # target | draft
    batch_invariant: bool = False  # --batch-invariant on: a backend may load the weights for it (llama.cpp: no repack)
    weights: str = "resident"  # resident: in the process's memory; mapped: file-backed pages (--weights)


@dataclass
class Model:
    """A loaded model: what its runners are made from, and what the tools read about it.

    Backends subclass it; the defaults say what a backend without the capability means."""

    backend: str
    tokenizer: object
    max_position: int  # the longest context the model was made for
    token_rows: int  # token ids it can both embed and score (tables may be padded past the tokenizer)
    quantization: str = "none"  # what was applied on load (auto resolved)
    threads: int | None = None  # CPU threads it computes with (None: torch's setting)
    hf_model: object | None = field(default=None, repr=False)  # the transformers module, where Supports.transformers

    def runner(self, *, batch_invariant: bool = False, trees: bool = False, draft: bool = False) -> "Runner":
        """A runner with its own (empty) cache over these weights: ``trees`` when a drafter grows trees,
        ``draft`` when it runs a draft model's calls (mostly one row each)."""
        raise NotImplementedError

    def batch_invariant_default(self, trees: bool, quantized: bool) -> bool:
        """What ``--batch-invariant auto`` means for this model (False where the backend has no such mode)."""
        return False

    def check_tree(self, batch: int, width: int, what: str) -> None:
        """Refuse trees of ``width`` nodes for ``batch`` sequences that the backend cannot express."""

    def requantized(self, mode: str) -> "Model":
        """A copy of this draft quantized to ``mode`` (bench compares modes over one load)."""
        raise BackendRefused(f"the {self.backend} backend does not requantize a loaded model to {mode}")

    def next_token_logits(self, token_ids: list[int], runner: "Runner") -> "torch.Tensor":
        """Float32 logits [V] of the token after ``token_ids``, teacher-forced; ``runner`` is an idle runner
        over this model the backend may use (slot 0)."""
        from specdecode.models.base import next_token_logits

        return next_token_logits(runner, token_ids)


class Backend:
    """One registered backend: its name, its :class:`Supports` row and its loader."""

    name: str
    description: str
    supports: Supports

    def missing(self) -> str | None:
        """Why it cannot run on this machine at all (not installed: say how to install), or None."""
        return None

    def spec_kind(self, spec: str) -> str:
        """What ``spec`` names, one of ``Supports.opens``' vocabulary (raises ModelNotFoundError)."""
        from specdecode.models.loading import resolve

        return resolve(spec).kind

    def refuses(self, request: Request) -> str | None:
        """Why this backend cannot run the request, in the user's terms (None: it can). Raises
        ModelNotFoundError when the target cannot be found at all."""
        s = self.supports
        kind = self.spec_kind(request.target)
        if kind not in s.opens:
            return f"it loads {s.opens_text}; --target {request.target!r} is not {s.opens_text}"
        reasons = []
        device = request.device.split(":")[0]
        if device != "auto" and device not in s.devices:
            reasons.append(f"it runs on {', '.join(s.devices)}, not {request.device}")
        if request.dtype != "auto" and not s.dtypes:
            reasons.append("--dtype is not its to set (it computes in the model file's own types)")
        if request.target_quantization != "none" and request.target_quantization not in s.target_quantizations:
            reasons.append(f"--target-quantization {request.target_quantization} is not one it applies")
        other = sorted(request.draft_modes - set(s.draft_modes) - {"none"})
        if other:
            reasons.append(
                f"--draft-quantization {'/'.join(other)} cannot pair with a target here "
                f"(it pairs {', '.join(s.draft_modes) or 'none'})"
            )
        if request.batch_invariant == "on" and not s.batch_invariant:
            reasons.append("--batch-invariant on replaces kernels it does not use")
        if request.features and not s.features:
            reasons.append(
                "an EAGLE drafter reads intermediate layers and feeds input embeddings, which it does not expose"
            )
        if request.trees and not s.trees:
            reasons.append("it does not verify trees (--tree-topk)")
        missing = self.missing()
        if missing:
            reasons.append(missing)
        return "; ".join(reasons) or None

    def opens(self, spec: str) -> bool:
        """Whether ``spec`` names a model this backend loads (False for what cannot be found)."""
        from specdecode.models.loading import ModelNotFoundError

        try:
            return self.spec_kind(spec) in self.supports.opens
        except ModelNotFoundError:
            return False

    def chosen_because(self, request: Request) -> str:
        """Why ``--backend auto`` picked it, when it was the first to accept."""
        return f"the first in the table that runs {self.supports.opens_text} with these settings"

    def ahead_in_auto(self, request: Request, measured) -> str | None:
        """Why ``--backend auto`` should take it ahead of the table's order (None: in its place). ``measured``
        (backend name, target) -> one-token decode tok/s from a cached profile of this machine, or None."""
        return None

    def load(self, spec: str, settings: Settings) -> Model:
        raise NotImplementedError
