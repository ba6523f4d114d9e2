"""load_model on a tiny GGUF written by the test: weights, logits, the safetensors cache, resolution.

No network and no real model: the GGUF comes from tests/gguf_util.py (2 layers, hidden 64, ~280 tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from gguf_util import SPECIAL, tiny_vocab, write_tiny_qwen2_gguf
from specdecode.models import fetch, loading
from specdecode.models.loading import (
    ModelNotFoundError,
    cache_dir_for,
    convert_gguf,
    load_model,
    resolve,
    tokenizers_compatible,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny GGUF, converted once (float32, in-process) into its own cache root."""
    root = tmp_path_factory.mktemp("cache")
    gguf = tmp_path_factory.mktemp("models") / "tiny.gguf"
    expected, config = write_tiny_qwen2_gguf(gguf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(root))
        cache, built = convert_gguf(gguf, torch.float32, in_subprocess=False)
    assert built
    return gguf, expected, config, root


@pytest.fixture
def cache_root(converted, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(converted[3]))
    return converted[3]


def _mapped_files() -> set[str]:
    """The safetensors files this process maps (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if line.rstrip().endswith(".safetensors")}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_weights_are_resident_by_default_and_mapped_on_request(converted, cache_root):
    """--weights resident (the default) copies the weights out of the safetensors memory map, which the
    kernel could drop and read back from disk mid-request; mapped keeps the map. Same weights, same logits."""
    import gc

    gguf = converted[0]
    cache = str(cache_dir_for(gguf, torch.float32))
    gc.collect()
    before = {f for f in _mapped_files() if f.startswith(cache)}
    mapped, _ = load_model(str(gguf), dtype=torch.float32, resident=False)
    assert {f for f in _mapped_files() if f.startswith(cache)} - before, "mapped weights should map the file"
    del mapped
    gc.collect()
    resident, _ = load_model(str(gguf), dtype=torch.float32)
    gc.collect()
    assert not {f for f in _mapped_files() if f.startswith(cache)}, "resident weights still map the file"
    mapped, _ = load_model(str(gguf), dtype=torch.float32, resident=False)
    ids = torch.tensor([[5, 260, 32, 270, 100, 3, 281]])
    with torch.no_grad():
        assert torch.equal(resident(ids).logits, mapped(ids).logits)
    for name, t in resident.state_dict().items():
        assert torch.equal(t, mapped.state_dict()[name]), name


def _no_conversion(*args, **kwargs):
    raise AssertionError("the GGUF conversion path was taken")


def test_gguf_loads_with_the_written_weights_and_reference_logits(converted, cache_root, monkeypatch):
    gguf, expected, config, _ = converted
    monkeypatch.setattr(loading, "_convert_into", _no_conversion)
    model, tokenizer = load_model(str(gguf), dtype=torch.float32)

    state = model.state_dict()
    assert set(state) == set(expected)
    for name, array in expected.items():  # Q8_0 tensors compare against their dequantized values
        torch.testing.assert_close(state[name], torch.from_numpy(array), rtol=0, atol=0, msg=name)

    reference = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=True)
    ids = torch.tensor([[5, 260, 32, 270, 100, 3, 281]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)

    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"

    text = "the cat is in def for"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids(SPECIAL) == [len(tokenizer) - 3, len(tokenizer) - 2, len(tokenizer) - 1]


def test_cache_is_written_once_and_reused(converted, cache_root, monkeypatch):
    gguf = converted[0]
    cache = cache_dir_for(gguf, torch.float32)
    assert cache.parent == cache_root / "converted" and cache.name.endswith("-float32")
    manifest = json.loads((cache / loading.MANIFEST).read_text())
    assert manifest["source"] == str(gguf.resolve()) and manifest["dtype"] == "float32"
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer.json").is_file()

    sources = []
    original = loading._from_pretrained
    monkeypatch.setattr(loading, "_from_pretrained", lambda src, *a, **k: sources.append(src) or original(src, *a, **k))
    monkeypatch.setattr(loading, "_convert_into", _no_conversion)
    monkeypatch.setattr(loading, "_convert_in_child", _no_conversion)
    load_model(gguf, dtype=torch.float32)
    assert sources == [cache]  # the GGUF file itself never reaches from_pretrained
    assert convert_gguf(gguf, torch.float32) == (cache, False)


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(gguf, seed=1)

    def interrupt(*args, **kwargs):  # the weights are written by now; the tokenizer is not
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", interrupt)
    with pytest.raises(KeyboardInterrupt):
        load_model(gguf, dtype=torch.float32, convert_in_subprocess=False)
    converted_dir = tmp_path / "cache" / "converted"
    assert not cache_dir_for(gguf, torch.float32).exists()
    assert list(converted_dir.iterdir()) == []  # the temp dir is gone too


def test_leftover_temp_dir_of_a_dead_process_is_not_a_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(gguf, seed=2)
    final = cache_dir_for(gguf, torch.float32)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = final.parent / f".tmp-{final.name}.{int(dead.stdout)}"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")

    _, built = convert_gguf(gguf, torch.float32, in_subprocess=False)
    assert built and not leftover.exists()
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


@pytest.mark.slow
def test_default_conversion_runs_in_a_child_process_in_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    expected, _ = write_tiny_qwen2_gguf(gguf, seed=3)
    monkeypatch.setattr(loading, "_convert_into", _no_conversion)  # only the child may convert
    model, _ = load_model(gguf)
    assert model.dtype == torch.bfloat16
    assert cache_dir_for(gguf, torch.bfloat16).name.endswith("-bfloat16")
    embed = torch.from_numpy(expected["model.embed_tokens.weight"]).to(torch.bfloat16)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], embed)


def test_an_alias_and_its_file_are_the_same_draft_model(converted, cache_root):
    from specdecode.build import ConfigError, same_draft_model

    gguf = converted[0]
    fetch.register_model("tiny-draft-alias", gguf)
    for twice in (["tiny-draft-alias", str(gguf)], [f"xvocab:{gguf}", "xvocab:tiny-draft-alias"]):
        with pytest.raises(ConfigError, match="names the same draft model"):
            same_draft_model(twice, "none")
    same_draft_model(["tiny-draft-alias", "tiny-draft-alias@int8"], "none")  # another quantization: two models
    same_draft_model(["tiny-draft-alias", "xvocab:tiny-draft-alias", "ngram"], "none")  # two kinds
    same_draft_model(["not-fetched-anywhere", str(gguf)], "none")  # an unknown name is load_pair's to refuse


# ---------------------------------------------------------------------------------------------------
# resolve


def test_resolve_kinds(converted, cache_root, tmp_path, monkeypatch):
    gguf = converted[0]
    assert resolve(str(gguf)).kind == "gguf"
    cache = cache_dir_for(gguf, torch.float32)
    assert resolve(str(cache)) == loading.ResolvedSpec(str(cache), "dir", cache)

    fetch.register_model("tiny-alias", gguf)
    resolved = resolve("tiny-alias")
    assert (resolved.kind, resolved.path, resolved.alias) == ("gguf", gguf.resolve(), "tiny-alias")
    assert "alias 'tiny-alias'" in resolved.describe()

    assert resolve("Qwen/Qwen2.5-0.5B") == loading.ResolvedSpec("Qwen/Qwen2.5-0.5B", "hub")
    with pytest.raises(ModelNotFoundError, match=r"models fetch qwen2\.5-coder"):
        resolve("qwen2.5-coder-0.5b")  # known but not fetched into this cache root
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve(str(tmp_path / "empty"))


def test_unreachable_hub_id_error_is_clear(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(loading, "_from_pretrained", offline)
    with pytest.raises(ModelNotFoundError, match=r"the hub could not provide it.*models list"):
        load_model("some-org/some-model")


def test_a_name_that_is_no_hub_id_is_never_looked_up(monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(loading, "_from_pretrained", no_hub)
    with pytest.raises(ModelNotFoundError, match="models list"):
        load_model("qwen2.5-coder-1.5")  # a mistyped alias: no waiting for an unreachable hub


# ---------------------------------------------------------------------------------------------------
# tokenizers_compatible


def _tokenizer(**vocab_kwargs) -> PreTrainedTokenizerFast:
    tokens, merges = tiny_vocab(**vocab_kwargs)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe), eos_token="<|im_end|>")


def _model(vocab_rows: int) -> int:
    """The token rows of a model padded to ``vocab_rows`` (what the torch backend reads off the module)."""
    from specdecode.models.backends.pytorch import token_rows

    config = Qwen2Config(
        vocab_size=vocab_rows,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return token_rows(Qwen2ForCausalLM(config))


def test_tokenizers_compatible_same_vocab_with_padded_embeddings():
    tok = _tokenizer()
    # Embedding rows padded past the tokenizer, and padded differently, as Qwen checkpoints do.
    assert tokenizers_compatible(tok, _tokenizer(), _model(len(tok) + 64), _model(len(tok) + 5)) is None
    assert tokenizers_compatible(tok, _tokenizer()) is None


def test_tokenizers_compatible_rejects_a_different_mapping():
    draft, target = _tokenizer(), _tokenizer(rename={126: "zz"})  # 126 is the byte "~"
    message = tokenizers_compatible(draft, target, _model(len(draft)), _model(len(target)))
    assert message is not None and "126: '~' vs 'zz'" in message


def test_tokenizers_compatible_rejects_tokens_a_model_cannot_embed():
    draft, target = _tokenizer(), _tokenizer()
    message = tokenizers_compatible(draft, target, _model(len(draft) - 3), _model(len(target)))
    assert message is not None and "cannot" in message and "<|endoftext|>" in message
