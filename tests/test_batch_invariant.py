"""Batch-invariant mode: rows computed bit for bit alike whatever shares the forward.

Each test compares bits (torch.equal), never closeness, except the reference test, which checks
the mode still computes attention (against the textbook formula, float64)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdecode.models import batch_invariant as bi
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy, serving

DTYPES = [torch.float32, torch.bfloat16]


def test_row_plans_chunk_and_pad_within_one_class():
    plan = bi.RowPlan((2, 3, 4, 8))
    assert plan.chunks(1) == [(1, 2)] and plan.chunks(5) == [(5, 8)] and plan.chunks(8) == [(8, 8)]
    assert plan.chunks(19) == [(8, 8), (8, 8), (3, 3)]
    # measured seconds per call decide: a 4-row call costing twice a 1-row call loses for single rows
    seconds = {1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0, 8: 4.0}
    assert bi.choose([(1,), (2, 3, 4, 8)], (1, 1, 1), seconds).sizes == (1,)
    assert bi.choose([(1,), (2, 3, 4, 8)], (1, 5, 8, 19), seconds).sizes == (2, 3, 4, 8)
    with pytest.raises(bi.InvarianceError):
        bi.choose([], (1,), seconds)


def test_plans_are_remembered_on_disk_for_later_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(bi, "_DISK", None)
    monkeypatch.setattr(bi, "_PLANS", {})
    weight = torch.randn(64, 32)
    bi.linear(torch.randn(3, 32), weight, None)
    saved = (tmp_path / "calibration" / "batch-invariant-plans.json").read_text()
    assert "linear" in saved and "step" in saved
    monkeypatch.setattr(bi, "_DISK", None)
    monkeypatch.setattr(bi, "_PLANS", {})
    monkeypatch.setattr(bi, "probe", lambda *a, **k: pytest.fail("probed again instead of reading the cache"))
    bi.linear(torch.randn(3, 32), weight, None)


def test_probe_separates_shape_dependent_kernels():
    """A fake kernel whose rounding depends on the call's row count (as a BLAS's blocking does)."""

    def run(rows):
        m = rows.shape[-2]
        return rows.sum(-1, keepdim=True) + (1e-3 if m >= 4 else 0.0) + (1e-3 if m >= 8 else 0.0)

    classes = bi.probe(run, (), 5, (1, 2, 4, 6, 8, 16), torch.float32, torch.device("cpu"))
    assert sorted(classes) == [(1, 2), (4, 6), (8, 16)]

    def positional(rows):  # a kernel whose result depends on where the row sits: no class at all
        return rows.sum(-1, keepdim=True) + torch.arange(rows.shape[-2], dtype=rows.dtype)[:, None]

    assert bi.probe(positional, (), 5, (2, 4), torch.float32, torch.device("cpu")) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(768, 384, generator=g) / 20).to(dtype)
    bias = torch.randn(768, generator=g).to(dtype)
    rows = torch.randn(64, 384, generator=g).to(dtype)
    alone = bi.linear(rows[:1], weight, bias)[0]
    for n in (2, 3, 5, 9, 17, 33, 64):
        for pos in (0, n // 2, n - 1):
            batch = torch.cat([rows[1 : 1 + pos], rows[:1], rows[1 + pos : n]])
            assert torch.equal(bi.linear(batch, weight, bias)[pos], alone), (n, pos)
    with bi.bulk():  # the bulk plan is its own class, equally independent of the batch
        alone_bulk = bi.linear(rows[:1], weight, bias)[0]
        assert torch.equal(bi.linear(torch.cat([rows[5:40], rows[:1]]), weight, bias)[-1], alone_bulk)
    torch.testing.assert_close(alone.float(), F.linear(rows[:1], weight, bias)[0].float(), rtol=2e-2, atol=2e-2)


def _reference_attention(q, k, v, visible, scaling):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("bool_mask", [True, False])
def test_attention_computes_attention(bool_mask):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 3, 16, generator=g)
    k, v = torch.randn(2, 2, 300, 16, generator=g), torch.randn(2, 2, 300, 16, generator=g)
    lengths = torch.tensor([120, 300])  # row 0 sees fewer keys (a shorter sequence in the batch)
    keys = torch.arange(300)
    visible = (keys[None, None, :] < (lengths[:, None, None] - 3 + torch.arange(3)[None, :, None]))[:, None]
    mask = visible if bool_mask else torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = bi.attention(None, q, k, v, mask, scaling=0.25)
    assert out.shape == (2, 3, 4, 16)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, visible, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_other_rows_or_padding(dtype):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 1, 16, generator=g).to(dtype)
    k, v = torch.randn(1, 2, 200, 16, generator=g).to(dtype), torch.randn(1, 2, 200, 16, generator=g).to(dtype)
    visible = torch.ones(1, 1, 1, 200, dtype=torch.bool)
    alone, _ = bi.attention(None, q, k, v, visible, scaling=0.25)
    # the same query as the last of 5 in a batch whose other row is 700 keys long (stale keys past 200)
    q5 = torch.cat([torch.randn(1, 4, 4, 16, generator=g).to(dtype), q], dim=2)
    q5 = torch.cat([q5, torch.randn(1, 4, 5, 16, generator=g).to(dtype)])
    k2 = torch.cat(
        [
            torch.cat([k, torch.randn(1, 2, 500, 16, generator=g).to(dtype)], 2),
            torch.randn(1, 2, 700, 16, generator=g).to(dtype),
        ]
    )
    v2 = torch.cat(
        [
            torch.cat([v, torch.randn(1, 2, 500, 16, generator=g).to(dtype)], 2),
            torch.randn(1, 2, 700, 16, generator=g).to(dtype),
        ]
    )
    seen = torch.arange(700)[None, None, :] < torch.tensor([196, 197, 198, 199, 200])[None, :, None]
    mask = torch.stack([seen[0], torch.ones(5, 700, dtype=torch.bool)])[:, None]
    batched, _ = bi.attention(None, q5, k2, v2, mask, scaling=0.25)
    assert torch.equal(batched[0, 4], alone[0, 0])


def _runner_logits(dtype, invariant):
    """The same 12 tokens after the same prompt: (a) alone, one token per forward; (b) after a batched
    prefill beside prompts of other lengths, four tokens per forward (a verify) beside three other rows."""
    vocab = 512
    runner = HFRunner(
        make_model(vocab, seed=3, layers=2, hidden=256, dtype=dtype),
        num_slots=4,
        max_len=512,
        batch_invariant=invariant,
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (40,), generator=g).tolist()
    cont = torch.randint(0, vocab, (12,), generator=g).tolist()
    others = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 150, 300)]
    runner.prefill([0], [prompt])
    alone = torch.stack(
        [
            runner.logits(runner.forward(torch.tensor([0]), torch.tensor([[t]]), torch.tensor([[40 + i]])).hidden)[0, 0]
            for i, t in enumerate(cont)
        ]
    )
    runner.prefill([0, 1, 2, 3], [prompt] + others)
    batched = []
    for i in range(0, 12, 4):
        ids = torch.tensor([cont[i : i + 4]] + [[5, 6, 7, 8]] * 3)
        pos = torch.tensor([[40 + i + j for j in range(4)]] + [[len(o) + i + j for j in range(4)] for o in others])
        batched.append(runner.logits(runner.forward(torch.tensor([0, 1, 2, 3]), ids, pos).hidden)[0])
    return alone, torch.cat(batched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_runner_logits_are_bitwise_independent_of_batch_and_verify_width(dtype):
    alone, batched = _runner_logits(dtype, invariant=True)
    assert torch.equal(alone, batched)
    plain_alone, _ = _runner_logits(dtype, invariant=False)
    torch.testing.assert_close(alone, plain_alone, rtol=0.05, atol=0.05 if dtype == torch.float32 else 0.5)


def test_negative_control_plain_kernels_depend_on_the_batch():
    """Without the mode the same comparison differs in bf16 (the BLAS blocks by shape). If a machine's
    kernels happen to be shape-independent for these sizes, there is nothing to control."""
    alone, batched = _runner_logits(torch.bfloat16, invariant=False)
    if torch.equal(alone, batched):
        pytest.skip("this machine's bf16 kernels gave equal rows at these shapes without the mode")
    assert not torch.equal(alone, batched)


def _engine(k, draft=True, slots=4, **engine_kwargs):
    vocab = 64
    target = make_model(vocab, seed=7, layers=2, hidden=128, dtype=torch.bfloat16)
    draft_model = perturbed_copy(target, noise=0.2) if draft else None
    for model in (target, draft_model):
        if model is not None:
            bi.enable(model)
    eng = make_engine(target, make_tokenizer(vocab), draft_model, k=k, num_slots=slots, max_len=256, **engine_kwargs)
    assert eng.target.batch_invariant
    return eng


PROMPTS = [[3, 4, 5, 6, 7] * 3, [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21]]


def test_engine_bf16_greedy_speculation_equals_target_only_and_batch_equals_alone():
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    reference = [_engine(0, draft=False, slots=1).generate([p], greedy)[0].token_ids for p in PROMPTS]
    spec = _engine(3)
    batched = [o.token_ids for o in spec.generate(PROMPTS, greedy)]
    assert batched == reference
    assert [spec.generate([p], greedy)[0].token_ids for p in PROMPTS] == reference


def test_engine_bf16_seeded_samples_do_not_depend_on_the_batch():
    sampled = [
        SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    spec = _engine(3)
    alone = [spec.generate([p], s)[0].token_ids for p, s in zip(PROMPTS, sampled)]
    together = [o.token_ids for o in spec.generate(PROMPTS, sampled)]
    assert together == alone


def test_trees_are_refused_with_batch_invariance():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdecode.cli",
            "generate",
            "--target",
            "nowhere",
            "--draft",
            "ngram",
            "--tree-topk",
            "2",
            "--batch-invariant",
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--batch-invariant" in out.stderr and "tree" in out.stderr


def test_bf16_server_concurrent_greedy_and_seeded_requests_equal_each_alone():
    """What the server promises under concurrency, in bf16, where plain kernels break it."""
    import asyncio

    import httpx

    from test_server_harness import KEY, one_torch_thread, serve  # noqa: F401

    tok = make_tokenizer(64)
    texts = ["abcabcabcabcab", "zyx", "0123456789" * 5, "qq", "hellohello", "ABCDEFG" * 3, "k", "mnopmnop"]
    greedy = [{"prompt": t, "max_tokens": 30, "temperature": 0, "ignore_eos": True} for t in texts]
    seeded = [
        {"prompt": t, "max_tokens": 30, "temperature": 0.9, "seed": 7 + i, "ignore_eos": True}
        for i, t in enumerate(texts[:4])
    ]
    ref = _engine(0, draft=False, slots=1)
    expected = [
        tok.decode(
            ref.generate([tok(t).input_ids], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))[
                0
            ].token_ids
        )
        for t in texts
    ]

    async def post_all(url, bodies):
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300, trust_env=False
        ) as client:
            replies = await asyncio.gather(*[client.post("/v1/completions", json=b) for b in bodies])
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["text"] for r in replies]

    with serve(_engine(3, slots=4, **serving()), max_queue=32) as s:
        together = asyncio.run(post_all(s.url, greedy + seeded))
        alone = [asyncio.run(post_all(s.url, [b]))[0] for b in seeded]
    assert together[: len(texts)] == expected
    assert together[len(texts) :] == alone


def test_auto_is_on_for_bf16_and_fp16_on_a_cpu_and_off_in_float32_or_with_trees():
    from specdecode.build import ConfigError, EngineConfig, batch_invariant_on, validate_config

    from specdecode.models.backends.pytorch import TorchModel

    fp32, bf16 = (
        TorchModel.wrap(make_model(32, dtype=dtype), make_tokenizer(32)) for dtype in (torch.float32, torch.bfloat16)
    )
    auto = EngineConfig("t", "ngram")
    assert batch_invariant_on(auto, bf16) and not batch_invariant_on(auto, fp32)
    assert batch_invariant_on(EngineConfig("t", "ngram", batch_invariant="on"), fp32)
    assert not batch_invariant_on(EngineConfig("t", "ngram", batch_invariant="off"), bf16)
    assert not batch_invariant_on(EngineConfig("t", "ngram", tree_topk=2), bf16)
    assert not batch_invariant_on(EngineConfig("t", "ngram", target_quantization="int8"), bf16)
    with pytest.raises(ConfigError, match="tree"):
        validate_config(EngineConfig("t", "ngram", tree_topk=2, batch_invariant="on"))
    with pytest.raises(ConfigError, match="auto, on or off"):
        batch_invariant_on(EngineConfig("t", "ngram", batch_invariant="sometimes"), bf16)


def test_no_rows_is_no_rows():
    assert bi.linear(torch.zeros(0, 8), torch.randn(4, 8), None).shape == (0, 4)


def test_prepare_probes_every_shape_a_model_uses_once_under_one_progress_bar(tmp_path, monkeypatch, capsys):
    """The runner chooses every plan when it is built (one progress bar, ``prepare``), so prefill,
    decode and verify forwards afterwards probe nothing (the lazy path would print one line per shape);
    a second runner over the same shapes probes nothing at all. Negative control: without ``prepare`` the
    same forwards do probe."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(bi, "_DISK", None)
    monkeypatch.setattr(bi, "_PLANS", {})
    vocab = 64
    target = make_model(vocab, seed=7, layers=2, hidden=128, dtype=torch.bfloat16)
    engine = make_engine(
        bi.enable(target), make_tokenizer(vocab), perturbed_copy(target, noise=0.2), k=3, num_slots=2, max_len=256
    )
    err = capsys.readouterr().err
    assert "batch-invariant mode: probing" in err and "%" in err  # the progress bar
    chosen = dict(bi._PLANS)
    assert any(k[0] == "bmm" for k in chosen) and any(k[2] == "bulk" for k in chosen)
    out = engine.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert sum(o.stats.drafted for o in out) > 0  # verify steps of k + 1 rows ran
    assert "probing" not in capsys.readouterr().err and chosen == bi._PLANS
    assert bi.prepare(target) == 0

    monkeypatch.setattr(bi, "_DISK", {})  # negative control: nothing prepared, nothing cached
    monkeypatch.setattr(bi, "_PLANS", {})
    monkeypatch.setattr(bi, "_remember", lambda key, plan: None)
    runner = HFRunner(target, num_slots=1, max_len=64)
    monkeypatch.setattr(bi, "_PLANS", {})
    runner.prefill([0], [PROMPTS[0]])
    assert "probing linear" in capsys.readouterr().err
