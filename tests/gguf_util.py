"""A tiny qwen2-architecture GGUF file, written with the `gguf` package, for loading tests.

The file has what a real Qwen2.5 GGUF has, only small: a byte-level BPE tokenizer (256 byte tokens,
a few merges, three control tokens) in the metadata, attention biases, an untied output matrix, and
a mix of F32 and Q8_0 tensors, so the dequantization path is exercised. ``write_tiny_qwen2_gguf``
returns the weights a loader should end up with (Q8_0 tensors already dequantized), under the
transformers parameter names, and the matching ``Qwen2Config`` keyword arguments.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Each merge adds the concatenation of its pair to the vocabulary. "Ġ" is the byte-level space.
MERGES = [
    ("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("r", "e"),
    ("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("Ġ", "s"), ("o", "r"), ("e", "n"), ("Ġ", "o"), ("d", "e"),
    ("Ġ", "f"), ("Ġf", "or"), ("i", "s"), ("Ġ", "i"), ("Ġi", "n"), ("Ġ", "d"), ("Ġd", "e"), ("Ġde", "f"),
]


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def tiny_vocab(extra_merges: int = len(MERGES), rename: dict[int, str] | None = None) -> tuple[list[str], list[str]]:
    """``(tokens, merges)``: bytes, then the first ``extra_merges`` merged tokens, then SPECIAL."""
    tokens = _byte_tokens()
    merges = []
    for left, right in MERGES[:extra_merges]:
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    tokens += SPECIAL
    for index, token in (rename or {}).items():
        tokens[index] = token
    return tokens, merges


def write_tiny_qwen2_gguf(path: Path, seed: int = 0, **vocab_kwargs) -> tuple[dict[str, np.ndarray], dict]:
    """Write the file; return ``(expected float32 weights by HF name, Qwen2Config kwargs)``."""
    tokens, merges = tiny_vocab(**vocab_kwargs)
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def rand(*shape, scale=0.2):
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
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3 = control, 1 = normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, array: np.ndarray, quantized: bool = False) -> None:
        if quantized:
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
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    return expected, config
