"""The llama.cpp backend: .gguf files as they are quantized, on llama.cpp's CPU kernels
(:class:`~specdecode.models.llamacpp.LlamaCppRunner`; installed by ``scripts/install-llamacpp.sh``).

A draft on it runs beside a target on any backend: ``--draft-quantization gguf`` keeps the file's own
types, ``q8_0``/``q4_0`` requantize it once into the cache. It exposes logits and the final hidden state
only, so EAGLE drafters (intermediate layers, input embeddings) need another backend. ``--batch-invariant on``
loads the target without llama.cpp's CPU repack and decodes in invariant widths (see the runner's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.models.backends.base import Backend, Model, Request, Settings, Supports

if TYPE_CHECKING:
    from specdecode.models.llamacpp import LlamaCppModel


@dataclass
class LlamaCppModelHandle(Model):
    model: LlamaCppModel | None = field(default=None, repr=False)
    source: str = ""  # the .gguf file named (a requantized copy is made from it)

    def runner(self, *, batch_invariant: bool = False, trees: bool = False, draft: bool = False):
        from specdecode.models.llamacpp import LlamaCppRunner

        # a draft's numerics never reach the output (greedy and coupled tokens are the target's): it stays fast
        assert self.model is not None  # set by the backend's load
        return LlamaCppRunner(self.model, trees=trees, invariant=batch_invariant and not draft)

    def check_tree(self, batch: int, width: int, what: str) -> None:
        from specdecode.models.llamacpp_tree import check_ids  # trees are sequence ids: a finite pool

        check_ids(batch, width, what)

    def requantized(self, mode: str) -> "LlamaCppModelHandle":
        return BACKEND.load(self.source, Settings(threads=self.threads, quantization=mode, role="draft"))


class LlamaCppBackend(Backend):
    name = "llamacpp"
    description = "llama.cpp's CPU kernels over .gguf files as quantized (llama-cpp-python)"
    supports = Supports(
        opens=("gguf",),
        opens_text="a .gguf file",
        devices=("cpu",),
        dtypes=False,
        quantizes=("gguf", "q8_0", "q4_0"),
        draft_modes=("gguf", "q8_0", "q4_0"),
        batch_invariant=True,
        trees=True,
        features=False,
        transformers=False,
    )

    def missing(self) -> str | None:
        from specdecode.models import llamacpp

        return None if llamacpp.available() else f"it needs llama-cpp-python: {llamacpp.INSTALL_HINT}"

    def chosen_because(self, request: Request) -> str:
        return "a .gguf target and llama-cpp-python is installed: the file's own quantized kernels"

    def load(self, spec: str, settings: Settings) -> LlamaCppModelHandle:
        from specdecode.models import llamacpp
        from specdecode.models.loading import ModelNotFoundError, load_gguf_tokenizer, resolve

        if not llamacpp.available():
            raise llamacpp.BackendMissing(f"the llama.cpp backend needs llama-cpp-python: {llamacpp.INSTALL_HINT}")
        resolved = resolve(spec)
        if resolved.kind != "gguf":
            raise ModelNotFoundError(f"{spec!r} is a {resolved.describe()}; the llama.cpp backend runs .gguf files")
        assert resolved.path is not None  # a local .gguf file
        mode = "gguf" if settings.quantization == "none" else settings.quantization
        path = resolved.path if mode == "gguf" else llamacpp.requantize(resolved.path, mode, settings.threads)
        invariant = settings.batch_invariant and settings.role == "target"
        model = llamacpp.LlamaCppModel(path, settings.threads, repack=not invariant, mmap=settings.weights == "mapped")
        return LlamaCppModelHandle(
            "llamacpp",
            load_gguf_tokenizer(resolved.path),
            model.context_length,
            model.vocab_size,
            mode if settings.role == "draft" else "none",
            model.threads,
            None,
            model,
            str(resolved.path),
        )


BACKEND = LlamaCppBackend()
