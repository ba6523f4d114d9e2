"""The ik_llama.cpp backend: .gguf files as they are quantized, on ik_llama.cpp's CPU kernels (its multi-column
``iqk_mul_mat`` kernels, weights repacked on load), through the llama.cpp runner
(:class:`~specdecode.models.llamacpp.LlamaCppRunner` over :class:`~specdecode.models.ik_llamacpp.IkBinding`;
installed by ``scripts/install-ik-llamacpp.sh``).

It serves what the llama.cpp backend serves, chains and trees, draft models, n-gram and Medusa drafters;
drafts quantized to q8_0/q4_0 are requantized and run by the llama.cpp backend beside it (when that is
installed). ``--batch-invariant on`` loads the target without repack (see :func:`repack_for`) and decodes in
the widths the runner probes invariant. ``--backend auto`` takes it ahead of llama.cpp only where a cached
``specdecode profile`` of this target on this machine measured it faster (:meth:`IkLlamaCppBackend.ahead_in_auto`).
"""

from __future__ import annotations

from specdecode.models.backends.base import Backend, Request, Settings, Supports
from specdecode.models.backends.llamacpp import LlamaCppModelHandle


def repack_for(settings: Settings) -> bool:
    """Whether to repack the weights on load: yes, except for a batch-invariant target. Repacked rows go
    through kernels that take the activation columns in groups, and whether a row's logits then equal its
    one-token decode bit for bit depends on the group; unrepacked, the runner's probe finds widths that do
    (the runner refuses the invariant mode over repacked weights, as on llama.cpp)."""
    return not (settings.batch_invariant and settings.role == "target")


class IkLlamaCppBackend(Backend):
    name = "ik_llamacpp"
    description = "ik_llama.cpp's CPU kernels over .gguf files as quantized, repacked on load (ik-llama-cpp-python)"
    supports = Supports(
        opens=("gguf",),
        opens_text="a .gguf file",
        devices=("cpu",),
        dtypes=False,
        quantizes=("gguf",),
        draft_modes=("gguf", "q8_0", "q4_0"),
        batch_invariant=True,
        trees=True,
        features=False,
        transformers=False,
        auto=False,  # not in the table's order: only ahead of it, where measured faster (ahead_in_auto)
    )

    def missing(self) -> str | None:
        from specdecode.models import ik_llamacpp

        return None if ik_llamacpp.available() else f"it needs ik-llama-cpp-python: {ik_llamacpp.INSTALL_HINT}"

    def ahead_in_auto(self, request: Request, measured) -> str | None:
        """Why ``--backend auto`` takes it ahead of the table: a cached profile of ``request.target`` on this
        machine has its one-token decode faster than llama.cpp's (``measured(backend, target)``: tok/s, or
        None where no profile is cached). None otherwise: auto keeps its usual choice."""
        if measured is None or self.refuses(request) is not None:
            return None
        ik, mainline = measured(self.name, request.target), measured("llamacpp", request.target)
        if ik is None or mainline is None or ik <= mainline:
            return None
        return (
            f"the cached profile of this machine measured it faster than llamacpp on this target: "
            f"{ik:.1f} vs {mainline:.1f} tok/s decoding one token"
        )

    def load(self, spec: str, settings: Settings) -> LlamaCppModelHandle:
        from specdecode.models import ik_llamacpp, llamacpp
        from specdecode.models.loading import ModelNotFoundError, load_gguf_tokenizer, resolve

        if not ik_llamacpp.available():
            raise llamacpp.BackendMissing(
                f"the ik_llamacpp backend needs ik-llama-cpp-python: {ik_llamacpp.INSTALL_HINT}"
            )
        if settings.quantization not in ("none", "gguf"):
            raise llamacpp.BackendUnsupported(
                f"the ik_llamacpp backend runs .gguf files as quantized, not requantized to {settings.quantization}"
            )
        resolved = resolve(spec)
        if resolved.kind != "gguf":
            raise ModelNotFoundError(f"{spec!r} is a {resolved.describe()}; the ik_llamacpp backend runs .gguf files")
        assert resolved.path is not None  # a local .gguf file
        model = llamacpp.LlamaCppModel(
            resolved.path,
            settings.threads,
            repack=repack_for(settings),
            mmap=settings.weights == "mapped",
            binding=ik_llamacpp.IK,
        )
        return LlamaCppModelHandle(
            "ik_llamacpp",
            load_gguf_tokenizer(resolved.path),
            model.context_length,
            model.vocab_size,
            "gguf" if settings.role == "draft" else "none",
            model.threads,
            None,
            model,
            str(resolved.path),
        )


BACKEND = IkLlamaCppBackend()
