"""Tiny models and tokenizers built from a config in code: no downloads, fast on CPU."""

from __future__ import annotations

import os
import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdecode.config import EngineSettings, default
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner

ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits  # 62 one-character tokens
EOS = "<eos>"


def make_tokenizer(vocab_size: int = 32) -> PreTrainedTokenizerFast:
    """Token i is one character (ALPHABET[i]); the last id is <eos>. Decoding concatenates."""
    chars = ALPHABET[: vocab_size - 1]
    vocab = {c: i for i, c in enumerate(chars)} | {EOS: vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    return fast


def make_model(
    vocab_size: int = 32,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    arch: str = "qwen2",
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
):
    """A random tiny causal LM. ``scale`` multiplies the output embedding (sharper logits when > 1).

    The weights are drawn on the CPU (equal on every device), then moved to ``$SPECDECODE_TEST_DEVICE``
    (default ``cpu``; ``scripts/gpu_check.py --tests`` sets ``cuda``).
    """
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab_size - 1,
        tie_word_embeddings=False,
    )
    cfg = Qwen2Config(**kw) if arch == "qwen2" else LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    model = (Qwen2ForCausalLM if arch == "qwen2" else LlamaForCausalLM)(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.02)
        model.get_output_embeddings().weight.mul_(scale * 8)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return model.to(os.environ.get("SPECDECODE_TEST_DEVICE", "cpu"))


def perturbed_copy(model, noise: float, seed: int = 1):
    """A draft that agrees with ``model`` more or less (noise 0 = identical), on ``$SPECDECODE_TEST_DEVICE``.

    Built and perturbed on the CPU (the same draft on every device), then moved.
    """
    torch.manual_seed(seed)
    draft = type(model)(model.config).to(next(model.parameters()).dtype).eval()
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(noise * p.std() * torch.randn_like(p))
    return draft.to(os.environ.get("SPECDECODE_TEST_DEVICE", "cpu"))


BACKEND = os.environ.get("SPECDECODE_TEST_BACKEND", "torch")  # llamacpp: make_engine runs the models on llama.cpp
_GGUF_COPIES: dict[int, tuple[object, object]] = {}


def runner_for(model, backend: str | None = None):
    """A runner over a tiny model: :class:`HFRunner`, or with ``backend="llamacpp"`` (default
    ``$SPECDECODE_TEST_BACKEND``) a llama.cpp runner over a GGUF copy of the same weights."""
    if (backend or BACKEND) != "llamacpp":
        return HFRunner(model)
    import tempfile
    from pathlib import Path

    from gguf_util import write_gguf_like
    from specdecode.models.llamacpp import LlamaCppModel, LlamaCppRunner

    if id(model) not in _GGUF_COPIES:  # one file per model object (kept alive beside it)
        path = Path(tempfile.mkdtemp(prefix="specdecode-gguf-")) / "model.gguf"
        _GGUF_COPIES[id(model)] = (model, LlamaCppModel(write_gguf_like(model, path), threads=1))
    return LlamaCppRunner(_GGUF_COPIES[id(model)][1])


def make_engine(
    target,
    tokenizer,
    draft=None,
    k: int = 0,
    num_slots: int = 4,
    max_len: int = 256,
    drafter=None,
    verifier=None,
    backend: str | None = None,
    **settings,
):
    """An engine on tiny models; it sizes both runners' caches itself (see :func:`runner_for`);
    ``settings`` go to its :class:`EngineSettings` (``serving()`` gives a server's)."""
    from specdecode.drafters.draft_model import DraftModelDrafter

    if draft is not None:
        drafter = DraftModelDrafter(runner_for(draft, backend))
    return Engine(
        runner_for(target, backend),
        tokenizer,
        drafter,
        k,
        EngineSettings(max_batch_size=num_slots, max_context=max_len, **settings),
        verifier=verifier,
    )


def serving(**changes) -> dict:
    """:class:`EngineSettings` of an engine built for serving, as `specdecode serve` builds it by default (the
    defaults the config declares for serve: first token from the target, drafter faults isolated, a step
    budget); ``changes``: other values (``max_num_batched_tokens=16``)."""
    names = ("first_token_from_target", "isolate_drafter_faults", "max_num_batched_tokens", "batched_tokens_per_seq")
    return {**{name: default(name, "serve") for name in names}, **changes}
