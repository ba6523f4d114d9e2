"""The torch backend: Hugging Face causal LMs in PyTorch, on the CPU or CUDA (:class:`~specdecode.models.hf.HFRunner`).

Loads what :func:`specdecode.models.loading.load_model` loads (a transformers directory, a .gguf file
converted once to a safetensors cache, a hub id), in the dtype decided for the device; quantizes a draft
(int8, int4, or auto: the fastest measured here) or, LOSSY and labelled, the target; and can compute
every row alike whatever the batch (:mod:`specdecode.models.batch_invariant`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdecode.models.backends.base import Backend, Model, Settings, Supports
from specdecode.models.device import resolve_device, resolve_dtype


def token_rows(model: Any) -> int:
    """Token ids a transformers model can both embed and score (a quantized head has out_features; its weight may
    be packed)."""
    rows = [model.get_input_embeddings().weight.shape[0]]
    output = model.get_output_embeddings()
    if output is not None:
        rows.append(int(getattr(output, "out_features", None) or output.weight.shape[0]))
    return min(rows)


@dataclass
class TorchModel(Model):
    module: torch.nn.Module = field(default=None, repr=False)  # type: ignore[assignment]
    name: str = ""  # what the user named (auto quantization caches its measurement under it)

    @classmethod
    def wrap(cls, module: torch.nn.Module, tokenizer, name: str = "", quantization: str = "none") -> "TorchModel":
        """A loaded transformers module as a backend model (tests and scripts build theirs in code)."""
        return cls(
            "torch",
            tokenizer,
            int(getattr(module.config, "max_position_embeddings", 4096)),
            token_rows(module),
            quantization,
            None,
            module,
            module,
            name,
        )

    def runner(self, *, batch_invariant: bool = False, trees: bool = False, draft: bool = False):
        from specdecode.models import batch_invariant as invariant
        from specdecode.models.hf import HFRunner

        if batch_invariant and draft:  # plans for a draft's calls: mostly one row each
            invariant.enable(self.module, invariant.DRAFT_WORKLOAD)
        return HFRunner(self.module, batch_invariant=batch_invariant)

    def batch_invariant_default(self, trees: bool, quantized: bool) -> bool:
        param = next(self.module.parameters())  # bf16/fp16 on a CPU: plain kernels flip greedy tokens with the batch
        return (
            param.device.type == "cpu"
            and param.dtype in (torch.bfloat16, torch.float16)
            and not trees
            and not quantized
        )

    def requantized(self, mode: str) -> "TorchModel":
        from specdecode.models.quantize import auto_mode, quantize_model

        resolved = auto_mode(self.module, self.name) if mode == "auto" else mode
        module = quantize_model(copy.deepcopy(self.module), resolved)
        return replace(self, module=module, hf_model=module, quantization=resolved)

    def next_token_logits(self, token_ids: list[int], runner=None) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=next(self.module.parameters()).device)
        return self.module(ids, logits_to_keep=1).logits[0, -1].float().cpu()


class TorchBackend(Backend):
    name = "torch"
    description = "PyTorch (transformers models), CPU or CUDA"
    supports = Supports(
        opens=("dir", "gguf", "hub"),
        opens_text="a transformers directory, a .gguf file or a hub id",
        devices=("cpu", "cuda"),
        dtypes=True,
        quantizes=("int8", "int4", "auto"),
        target_quantizations=("int8", "int4"),
        draft_modes=("int8", "int4", "auto", "gguf", "q8_0", "q4_0"),
        batch_invariant=True,
        trees=True,
        features=True,
        transformers=True,
    )

    def refuses(self, request):
        from specdecode.models.loading import ModelNotFoundError

        try:
            return super().refuses(request)
        except ModelNotFoundError:
            return None  # loading says what is wrong with the name

    def load(self, spec: str, settings: Settings) -> TorchModel:
        from specdecode.models.loading import load_model

        device = resolve_device(settings.device)
        module, tokenizer = load_model(
            spec, resolve_dtype(settings.dtype, device), device, resident=settings.weights == "resident"
        )
        mode = settings.quantization
        if settings.role == "target" and mode != "none":  # LOSSY, labelled: see specdecode.models.quantize
            from specdecode.models.quantize import quantize_model

            quantize_model(module, mode, row_independent=True)
        elif mode != "none":
            from specdecode.models.quantize import auto_mode, quantize_model

            if mode == "auto":
                mode = auto_mode(module, spec)
            if mode != "none":
                quantize_model(module, mode)
        model = TorchModel.wrap(module, tokenizer, spec, mode)
        model.threads = settings.threads
        return model


BACKEND = TorchBackend()
