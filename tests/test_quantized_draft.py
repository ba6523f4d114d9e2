"""Quantized drafts (int8 / int4 weights): the verified distribution is the quantized draft's own, so
decoding stays exact — greedy equality, the chi-square law through the engine (ALPHA = 1e-4 per
setting), the check's parts — and specs, auto calibration and the bench sweep behave."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.check import CheckConfig, run_check
from specdecode.check.report import PASS
from specdecode.config import EngineSettings
from specdecode.drafters import parse_draft
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Engine
from specdecode.models import quantize as Q
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from test_engine import ALPHA, VS, chi_square_p, exact_two_token_law, sample_pairs
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 5, 6]]


def quantized(model, mode):
    return Q.quantize_model(perturbed_copy(model, noise=0.0), mode)  # a copy: the original stays float


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_replace_every_linear_and_stay_close(mode):
    model = make_model(V, seed=1, hidden=64)
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        ref = model(ids).logits
        q = quantized(model, mode)
        out = q(ids).logits
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert q.quantization == mode and HFRunner(q).vocab_size == V
    assert (out - ref).abs().max() < (0.2 if mode == "int8" else 0.8) * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernels_follow_the_measured_choice(dtype):
    """On the CPU a float32 draft gets dynamic int8 (fbgemm), a bf16 draft and any quantized target the
    weight-only kernel; logits keep the model's dtype and stay close."""
    model = make_model(V, seed=1, hidden=64).to(dtype)
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        ref = model(ids).logits.float()
        draft = Q.quantize_model(perturbed_copy(model, noise=0.0), "int8")
        target = Q.quantize_model(perturbed_copy(model, noise=0.0), "int8", row_independent=True)
        out_draft, out_target = draft(ids).logits, target(ids).logits
    kinds = {type(m) for m in draft.modules()}
    assert (Q.DynamicInt8Linear in kinds) == (dtype == torch.float32)
    assert (Q.Int8WeightOnlyLinear in kinds) == (dtype != torch.float32)
    assert Q.DynamicInt8Linear not in {type(m) for m in target.modules()}
    assert out_draft.dtype == out_target.dtype == dtype
    for out in (out_draft, out_target):
        assert (out.float() - ref).abs().max() < 0.2 * ref.abs().max()


def test_dynamic_int8_scales_weights_per_output_channel():
    """One scale per tensor (torch.ao's default) lost agreement on the real draft: per channel it is."""
    linear = torch.nn.Linear(64, 16)
    with torch.no_grad():
        linear.weight[0] *= 50  # one loud output channel must not coarsen the others
    q = Q.DynamicInt8Linear(linear).inner
    assert q.weight().qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric)
    x = torch.randn(3, 64)
    err = (q(x) - linear(x))[:, 1:].abs().max()
    assert err < 0.05 * linear(x)[:, 1:].abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_greedy_with_a_quantized_draft_equals_target_only(mode):
    target = make_model(V, seed=0, hidden=64)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = make_engine(target, TOK, num_slots=2).generate(PROMPTS, params)
    engine = Engine(
        HFRunner(target),
        TOK,
        DraftModelDrafter(HFRunner(quantized(target, mode))),
        4,
        EngineSettings(max_batch_size=2, max_context=64),
    )
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.stats.accepted for o in outs) > 0


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["T1", "T0.7-p0.9"])
def test_quantized_draft_keeps_the_target_law(sp):
    """4000 samples of the first two tokens; the draft is the int8 copy of a perturbed target."""
    target = make_model(VS, seed=5, scale=0.5)
    draft = Q.quantize_model(perturbed_copy(target, noise=0.6, seed=3), "int8")
    engine = Engine(
        HFRunner(target),
        make_tokenizer(VS),
        DraftModelDrafter(HFRunner(draft)),
        3,
        EngineSettings(max_batch_size=250, max_context=8),
    )
    counts = sample_pairs(engine, [1, 2, 3], sp, 4000, 250)
    assert chi_square_p(counts, exact_two_token_law(target, [1, 2, 3], sp), 4000) > ALPHA


def test_check_passes_with_a_quantized_draft():
    from test_check import CFG, PROMPTS as CHECK_PROMPTS, TOK as CHECK_TOK, V as CV

    target = make_model(CV, seed=5, scale=0.5)
    draft = Q.quantize_model(perturbed_copy(target, noise=0.3, seed=3), "int8")

    def factory(k, batch):
        drafter = DraftModelDrafter(HFRunner(draft)) if k else None
        return Engine(HFRunner(target), CHECK_TOK, drafter, k, EngineSettings(max_batch_size=batch, max_context=64))

    report = run_check(factory, CHECK_PROMPTS, CheckConfig(**{**CFG.__dict__, "parts": (1, 3)}))
    assert report.part(1).status == PASS and report.part(3).status == PASS, [p.summary for p in report.parts]


def test_specs_carry_the_quantization():
    assert parse_draft("qwen2.5-coder-0.5b@int8").quantization == "int8"
    assert parse_draft("qwen2.5-coder-0.5b@int8").arg == "qwen2.5-coder-0.5b"
    assert parse_draft("model:/m/x@int4").quantization == "int4"
    assert parse_draft("org/name@main").quantization is None  # not a mode: part of the name
    with pytest.raises(ValueError, match="unknown quantization"):
        Q.quantize_model(make_model(V), "int3")


def test_auto_is_measured_once_and_cached_per_key(tmp_path, monkeypatch):
    model = make_model(V, seed=1, hidden=64)
    calls = []
    real = Q._time_forward
    monkeypatch.setattr(Q, "_time_forward", lambda m, reps=5: calls.append(1) or real(m, reps=1))
    first = Q.auto_mode(model, "m", tmp_path)
    assert first in ("none", "int8", "int4") and calls
    n = len(calls)
    assert Q.auto_mode(model, "m", tmp_path) == first and len(calls) == n  # cached
    Q.auto_mode(model.to(torch.bfloat16), "m", tmp_path)  # another dtype: measured again
    assert len(calls) > n
    cached = [json.loads(p.read_text())["key"] for p in (tmp_path / "calibration").glob("*.json")]
    assert sorted(k.split("|")[2] for k in cached) == ["torch.bfloat16", "torch.float32"]


@pytest.mark.parametrize("cls", [Q.Int8WeightOnlyLinear, Q.Int4WeightOnlyLinear])
def test_quantizing_in_row_blocks_gives_the_same_weights(cls, monkeypatch):
    """Blocks bound the float32 working copy (peak RSS); the packed weights must not notice them."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 80).to(torch.bfloat16)
    whole = cls(linear)
    monkeypatch.setattr(Q, "ROW_BLOCK", 64)  # 80 rows: a full tile and a tail
    blocked = cls(linear)
    for name, buf in whole.named_buffers():
        assert torch.equal(buf, dict(blocked.named_buffers())[name]), name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_lets_go_of_a_memory_mapped_weights_file(tmp_path, mode):
    """The unquantized parameters (the embedding, the norms) may be views of a memory-mapped file, as
    loaded from safetensors; after quantizing, none of them refers to the map any more (so it, and the
    file pages quantizing read, can be let go) and their values are unchanged."""
    import gc
    import weakref

    import numpy as np

    model = make_model(256, seed=0, hidden=64).to(torch.bfloat16)
    emb = model.get_input_embeddings().weight
    raw = emb.detach().view(torch.int16).numpy()
    mapped = np.memmap(tmp_path / "weights.bin", dtype=np.int16, mode="w+", shape=raw.shape)
    mapped[:] = raw
    emb.data = torch.from_numpy(mapped).view(torch.bfloat16)  # the embedding now reads the mapped file
    before = emb.detach().clone()
    alive = weakref.ref(mapped)
    del mapped, raw
    gc.collect()
    assert alive() is not None  # the model holds it
    Q.quantize_model(model, mode)
    gc.collect()
    assert alive() is None  # nothing refers to the map any more
    assert torch.equal(model.get_input_embeddings().weight, before)
