"""A tiny qwen2-architecture GGUF file, written with the `gguf` package, for loading tests.

The file has what a real Qwen2.5(-Coder) GGUF has, only small: a byte-level BPE tokenizer (256 byte
tokens, a few merges, four fill-in-the-middle and three other control tokens) in the metadata,
attention biases, an untied output matrix, and a mix of F32 and Q8_0 tensors, so the dequantization
path is exercised. ``write_tiny_qwen2_gguf`` returns the weights a loader should end up with (Q8_0
tensors already dequantized), under the transformers parameter names, and the matching
``Qwen2Config`` keyword arguments.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"]  # Qwen2.5-Coder's, in its order
# Each merge adds the concatenation of its pair to the vocabulary. "Ġ" is the byte-level space.
MERGES = [
    ("h", "e"),
    ("Ġ", "t"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "c"),
    ("a", "t"),
    ("Ġc", "at"),
    ("Ġ", "s"),
    ("o", "r"),
    ("e", "n"),
    ("Ġ", "o"),
    ("d", "e"),
    ("Ġ", "f"),
    ("Ġf", "or"),
    ("i", "s"),
    ("Ġ", "i"),
    ("Ġi", "n"),
    ("Ġ", "d"),
    ("Ġd", "e"),
    ("Ġde", "f"),
]


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def tiny_vocab(extra_merges: int = len(MERGES), rename: dict[int, str] | None = None) -> tuple[list[str], list[str]]:
    """``(tokens, merges)``: bytes, then the first ``extra_merges`` merged tokens, then FIM_TOKENS (control
    tokens, as in Qwen2.5-Coder, so fill-in-the-middle works), then SPECIAL."""
    tokens = _byte_tokens()
    merges = []
    for left, right in MERGES[:extra_merges]:
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    tokens += FIM_TOKENS + SPECIAL
    for index, token in (rename or {}).items():
        tokens[index] = token
    return tokens, merges


def write_tiny_qwen2_gguf(
    path: Path,
    seed: int = 0,
    *,
    quantized: bool = True,
    tokens: list[str] | None = None,
    scale: float = 0.2,
    **vocab_kwargs,
) -> tuple[dict[str, np.ndarray], dict]:
    """Write the file; return ``(expected float32 weights by HF name, Qwen2Config kwargs)``.

    ``quantized=False`` stores every tensor in F32; ``tokens`` replaces the byte-level vocabulary
    with these token strings (one nominal merge; the last one is the end-of-sequence token), for tests that
    need a small vocabulary; ``scale`` is the weights' standard deviation."""
    if tokens is None:
        tokens, merges = tiny_vocab(**vocab_kwargs)
        special = SPECIAL
    else:
        tokens, merges, special = list(tokens), [f"{tokens[0]} {tokens[1]}"], [tokens[-1]]  # llama.cpp wants a merge
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    quantize_some = quantized

    def rand(*shape, scale=scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2")
    writer.add_context_length(256)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    control = set(special) | set(FIM_TOKENS)
    writer.add_token_types([3 if t in control else 1 for t in tokens])  # 3 = control, 1 = normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(special[0]))
    writer.add_eos_token_id(tokens.index(special[-1]))
    writer.add_pad_token_id(tokens.index(special[0]))
    writer.add_add_bos_token(False)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, array: np.ndarray, quantized: bool = False) -> None:
        if quantized and quantize_some:
            packed = quantize(array, GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, packed, raw_dtype=GGMLQuantizationType.Q8_0)
            expected[hf_name] = dequantize(packed, GGMLQuantizationType.Q8_0).astype(np.float32)
        else:
            writer.add_tensor(gguf_name, array)
            expected[hf_name] = array

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN))
    add("output.weight", "lm_head.weight", rand(vocab, HIDDEN), quantized=True)
    add("output_norm.weight", "model.norm.weight", 1 + rand(HIDDEN, scale=0.05))
    for i in range(LAYERS):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", 1 + rand(HIDDEN, scale=0.05))
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", 1 + rand(HIDDEN, scale=0.05))
        for proj, rows in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim)):
            add(f"{blk}.attn_{proj}.weight", f"{hf}.self_attn.{proj}_proj.weight", rand(rows, HIDDEN))
            add(f"{blk}.attn_{proj}.bias", f"{hf}.self_attn.{proj}_proj.bias", rand(rows))
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", rand(HIDDEN, HIDDEN))
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", rand(FFN, HIDDEN), quantized=True)
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", rand(FFN, HIDDEN), quantized=True)
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", rand(HIDDEN, FFN), quantized=True)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return expected, config


def write_gguf_like(model, path: Path, tokens: list[str] | None = None) -> Path:
    """Write a tiny transformers Qwen2 or Llama model's own weights (F32) as a GGUF file, so llama.cpp
    runs the very model a torch test runs. ``tokens``: the vocabulary's strings (default ``t0``,
    ``t1``, ...; the last id is end-of-sequence, as in tests/tiny.py)."""
    cfg = model.config
    arch = cfg.model_type
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"only qwen2 and llama models convert here, not {arch}")
    vocab = cfg.vocab_size
    # default: "x", "y", "xy" (llama.cpp wants a merge, and a tokenizer's merge must make a token it has),
    # then "t3", "t4", ...; the strings matter only to a tokenizer rebuilt from the file
    tokens = (
        list(tokens)
        if tokens is not None
        else (["x", "y", "xy"] + [f"t{i}" for i in range(3, vocab - 1)] + ["<|endoftext|>"])
    )
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch} (from a transformers model)")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i == vocab - 1 else 1 for i in range(vocab)])
    writer.add_token_merges(["x y"] if tokens[:3] == ["x", "y", "xy"] else [f"{tokens[0]} {tokens[1]}"])
    writer.add_eos_token_id(vocab - 1)
    writer.add_bos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for proj in "qkv":
        per_layer[f"self_attn.{proj}_proj.weight"] = f"attn_{proj}.weight"
        if arch == "qwen2":
            per_layer[f"self_attn.{proj}_proj.bias"] = f"attn_{proj}.bias"
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"

    def rope_order(w: np.ndarray, heads: int) -> np.ndarray:
        """llama.cpp's llama rotates interleaved pairs; transformers' rotates halves (as convert_hf_to_gguf)."""
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for hf, gg in names.items():
        w = state[hf]
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = rope_order(w, cfg.num_attention_heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            w = rope_order(w, cfg.num_key_value_heads)
        writer.add_tensor(gg, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_llamacpp_pair(directory: Path, vocab: int, seed: int, noise: float = 0.15):
    """A tiny target, a draft that mostly agrees (transformers models), and their GGUF copies written to
    ``directory`` and loaded by llama.cpp on one thread: ``(target, draft, gguf_target, gguf_draft)``."""
    from specdecode.models.llamacpp import LlamaCppModel
    from tiny import make_model, perturbed_copy

    target = make_model(vocab, seed=seed)
    draft = perturbed_copy(target, noise=noise)
    return (
        target,
        draft,
        LlamaCppModel(write_gguf_like(target, directory / "t.gguf"), threads=1),
        LlamaCppModel(write_gguf_like(draft, directory / "d.gguf"), threads=1),
    )
