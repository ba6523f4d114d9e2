"""EAGLE: extract -> train -> draft on tiny models (no downloads).

Exactness through the engine for chains and dynamic trees (greedy equality against target-only
decoding, the chi-square law of two tokens at ALPHA = 1e-4 per setting: an untrained drafter is as
good for that as a trained one), the features the drafter is handed are the target's own, the draft
cache after rollback equals a fresh feed of the accepted tokens, training lowers the loss, resumes and
reloads bit-exact, and a drafter for another target or layer set is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdecode.config import EngineSettings
from specdecode.drafters.base import TargetFeatures
from specdecode.drafters.eagle import EagleDrafter, check_target
from specdecode.engine import Engine
from specdecode.heads import features as F
from specdecode.heads.eagle_train import EagleSettings, resolve_layers, train
from specdecode.models.base import FINAL
from specdecode.models.eagle import EagleConfig, EagleModel, decoder_config, eagle3_layers
from specdecode.models.hf import HFRunner
from specdecode.models.medusa import HeadsError
from specdecode.sampling import SamplingParams
from test_engine import ALPHA, VS, chi_square_p, exact_two_token_law, sample_pairs
from test_medusa import PROMPTS, TOK, V, run_extract, write_corpus
from tiny import make_model, make_tokenizer

# only a guard against a hang: on a busy CI machine a run can take many times its usual tens of seconds
SUBPROCESS_TIMEOUT_S = 1800


def tiny_eagle(target, layers=("final",), draft_vocab=None, seed=0, scale=1.0) -> EagleModel:
    """An untrained EAGLE drafter for ``target`` (random layer, scaled up so it drafts varied tokens)."""
    runner = HFRunner(target)
    vocab = runner.vocab_size
    draft_vocab = draft_vocab or vocab - 4
    gen = torch.Generator().manual_seed(seed)
    id_map = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    cfg = EagleConfig(
        runner.hidden_size,
        vocab,
        draft_vocab,
        list(layers),
        decoder_config(target.config, draft_vocab, 48),
        target={"spec": "tiny", "num_layers": runner.num_layers, "fingerprint": F.model_fingerprint(runner)},
    )
    torch.manual_seed(seed)
    model = EagleModel(cfg, id_map)
    with torch.no_grad():
        model.out.weight.copy_(target.get_output_embeddings().weight[id_map] * scale)
        layer = model.decoder.base_model.layers[0]  # residual branches start at zero: make them matter
        layer.self_attn.o_proj.weight.normal_(0, 0.2)
        layer.mlp.down_proj.weight.normal_(0, 0.2)
    return model.eval()


def eagle_engine(target, model, k=3, topk=1, nodes=0, slots=4, max_len=128):
    drafter = EagleDrafter(model, HFRunner(target), tree_topk=topk, tree_nodes=nodes)
    return Engine(HFRunner(target), TOK, drafter, k, EngineSettings(max_batch_size=slots, max_context=max_len))


@pytest.fixture(scope="module")
def target():
    return make_model(V, seed=3, hidden=32)


# -- drafting -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [("final",), ("layer1", "layer2")], ids=["eagle1", "fusion"])
@pytest.mark.parametrize("topk,nodes", [(1, 0), (3, 8)], ids=["chain", "tree"])
def test_greedy_with_eagle_equals_target_only(target, layers, topk, nodes):
    ref = Engine(HFRunner(target), TOK, None, 0, EngineSettings(max_batch_size=4, max_context=128))
    params = [SamplingParams(0.0, max_new_tokens=24, ignore_eos=True) for _ in PROMPTS]
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    engine = eagle_engine(target, tiny_eagle(target, layers), k=3, topk=topk, nodes=nodes)
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.drafted for o in outs) > 0


def test_the_draft_layer_computes_in_bf16_only_where_bf16_is_native(monkeypatch):
    import specdecode.models.device as D
    from specdecode.drafters.eagle import draft_dtype

    monkeypatch.setattr(D, "native_bf16", lambda device="cpu": True)
    assert draft_dtype("cpu", torch.bfloat16) == torch.bfloat16
    assert draft_dtype("cpu", torch.float32) == torch.float32
    monkeypatch.setattr(D, "native_bf16", lambda device="cpu": False)  # AVX2-only: emulated bf16 is slower
    assert draft_dtype("cpu", torch.bfloat16) == torch.float32
    assert draft_dtype("cuda:0", torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("topk,nodes", [(1, 0), (3, 8)], ids=["chain", "tree"])
def test_a_bf16_draft_layer_on_a_bf16_target_keeps_greedy_equality(topk, nodes):
    target = make_model(V, seed=3, hidden=32).to(torch.bfloat16)
    ref = Engine(HFRunner(target), TOK, None, 0, EngineSettings(max_batch_size=4, max_context=128))
    params = [SamplingParams(0.0, max_new_tokens=24, ignore_eos=True) for _ in PROMPTS]
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    drafter = EagleDrafter(tiny_eagle(target), HFRunner(target), dtype=torch.bfloat16, tree_topk=topk, tree_nodes=nodes)
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    outs = Engine(HFRunner(target), TOK, drafter, 3, EngineSettings(max_batch_size=4, max_context=128)).generate(
        PROMPTS, params
    )
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.drafted for o in outs) > 0


def test_the_drafter_is_handed_the_targets_own_features_and_reads_them(target):
    model = tiny_eagle(target, ("layer1", "final"))
    engine = eagle_engine(target, model, k=2)
    seen = []
    original = engine.drafter.observe

    def spy(slots, features):
        seen.extend(features)
        return original(slots, features)

    engine.drafter.observe = spy
    out = engine.generate([PROMPTS[1]], [SamplingParams(0.0, max_new_tokens=10, ignore_eos=True)])[0]
    tokens = PROMPTS[1] + out.token_ids
    with torch.no_grad():
        hs = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    covered = 0
    for f in seen:
        n = len(f.token_ids)
        assert f.token_ids == tokens[f.start : f.start + n]
        torch.testing.assert_close(f.hidden[FINAL], hs[-1][0, f.start : f.start + n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(f.hidden[1], hs[1][0, f.start : f.start + n], atol=1e-4, rtol=1e-4)
        assert f.start == covered  # contiguous: every cached token once
        covered += n
    assert covered >= len(tokens) - 2


def test_first_draft_comes_from_the_pair_before_the_pending_token(target):
    """Draft 1 = argmax of the drafter fed (features of tokens 0..n-2, tokens 1..n-1), computed by hand."""
    model = tiny_eagle(target)
    drafter = EagleDrafter(model, HFRunner(target))
    drafter.reserve(1, 64)
    ctx = PROMPTS[3]
    with torch.no_grad():
        feats = target(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    drafter.start([0], [ctx])
    drafter.observe([0], [TargetFeatures(0, ctx[:-1], {FINAL: feats})])

    class Seq:
        slot, token_ids, params, generator = 0, ctx, SamplingParams(0.0), torch.Generator()

    prop = drafter.propose([Seq()], [1])
    with torch.no_grad():
        emb = target.get_input_embeddings()(torch.tensor([ctx[1:]]))
        x = model.step_input(model.features([feats[None]]), emb)
        base = model.decoder.base_model
        pos = torch.arange(len(ctx) - 1)[None]
        h = base.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=base.rotary_emb(x, pos))
        h = h[0] if isinstance(h, tuple) else h
        logits = model.out(model.to_feature(base.norm(h)))[0, -1]
    assert int(prop.tokens[0, 0]) == int(model.id_map[logits.argmax()])


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["t1", "t0.7p0.9"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_eagle_keeps_the_target_law(sp, tree):
    model = make_model(VS, seed=4, hidden=32)
    drafter = EagleDrafter(
        tiny_eagle(model, draft_vocab=VS - 2, scale=2.0),
        HFRunner(model),
        tree_topk=3 if tree else 1,
        tree_nodes=5 if tree else 0,
    )
    engine = Engine(HFRunner(model), make_tokenizer(VS), drafter, 2, EngineSettings(max_batch_size=50, max_context=32))
    prompt = [1, 2, 3]
    n = 3000
    counts = sample_pairs(engine, prompt, sp, n, batch=50)
    assert chi_square_p(counts, exact_two_token_law(model, prompt, sp), n) > ALPHA


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_check_passes_an_eagle_engine(target, tree):
    from specdecode.check import CheckConfig, run_check
    from specdecode.check.report import PASS

    model = tiny_eagle(target, scale=2.0)
    cfg = CheckConfig(num_draft_tokens=3, parts=(1, 3), law_contexts=2, law_samples=1000, e2e_samples=200, e2e_batch=50)

    def factory(k, batch):
        drafter = EagleDrafter(model, HFRunner(target), tree_topk=2 if tree else 1, tree_nodes=4 if tree else 0)
        return Engine(
            HFRunner(target), TOK, drafter if k else None, k, EngineSettings(max_batch_size=batch, max_context=64)
        )

    report = run_check(factory, [[1, 2, 3], [4, 5, 6, 7, 8]], cfg)
    assert {p.part: p.status for p in report.parts if p.part in (1, 3)} == {1: PASS, 3: PASS}, [
        p.summary for p in report.parts
    ]


# -- training -------------------------------------------------------------------------------------------
SETTINGS2 = F.ExtractSettings(
    layers=(FINAL, 1), seq_len=48, max_tokens=900, topk=4, shard_tokens=100, max_doc_tokens=96, min_chunk=8
)


@pytest.fixture(scope="module")
def feats(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("eagle")
    run_extract(target, write_corpus(root / "corpus"), root / "feats", SETTINGS2)
    return root / "feats"


def train_tiny(target, feats, out, **kw):
    settings = EagleSettings(
        **{"draft_vocab": 24, "intermediate_size": 48, "epochs": 4, "batch_chunks": 2, "lr": 3e-3, **kw}
    )
    return train(F.FeatureSet(feats), out, settings, target, checkpoint_every=5, evals=3, progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, feats):
    return train_tiny(target, feats, tmp_path_factory.mktemp("trained") / "eagle", epochs=8)


def test_rollback_leaves_the_draft_cache_equal_to_a_fresh_feed(target, trained, feats):
    """After steps with partial acceptance, the drafter's true K/V equal those of a new drafter that is
    handed the same sequence at once."""
    model = trained
    engine = eagle_engine(target, model, k=4, slots=1)
    prompt = F.FeatureSet(feats)["input_ids"][:24].tolist()  # training text: the drafter is often right there
    seq = engine.add(prompt, SamplingParams(0.0, max_new_tokens=60, ignore_eos=True))
    partial = 0
    for _ in range(30):
        for ev in engine.step():
            partial += 0 < ev.accepted < ev.drafted
        if partial >= 2 or seq.finished:
            break
    assert partial > 0, "no partial acceptance happened: the test proves nothing"
    drafter = engine.drafter
    # one more catch-up so every accepted token's pair is in the cache
    drafter._catch_up([seq])
    done = drafter.slots[seq.slot].done
    fresh = EagleDrafter(model, HFRunner(target))
    fresh.reserve(1, 128)
    ids = seq.token_ids
    with torch.no_grad():
        feats = target(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    fresh.start([0], [ids])
    fresh.observe([0], [TargetFeatures(0, ids[:-1], {FINAL: feats})])
    fresh._catch_up([seq])
    k_a = drafter.runner.cache.keys[0][seq.slot, :, :done]
    k_b = fresh.runner.cache.keys[0][0, :, :done]
    torch.testing.assert_close(k_a, k_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        drafter.runner.cache.values[0][seq.slot, :, :done],
        fresh.runner.cache.values[0][0, :, :done],
        atol=1e-4,
        rtol=1e-4,
    )


def test_training_lowers_the_loss_and_the_drafter_reloads_bit_exact(tmp_path, target, feats):
    model = train_tiny(target, feats, tmp_path / "eagle")
    log = json.loads((tmp_path / "eagle" / "train_log.json").read_text())
    first, last = sum(r[1] for r in log[:5]) / 5, sum(r[1] for r in log[-5:]) / 5
    assert last < first
    again = EagleModel.load(tmp_path / "eagle")
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    acc = cfg["accuracy"]
    assert len(acc["top1"]) == len(acc["chain"]) >= 3 and all(0 <= x <= 1 for x in acc["top1"])
    assert all(a >= b for a, b in zip(acc["chain"], acc["chain"][1:]))  # P(all of 1..p right) never grows
    assert cfg["training"]["curve"] and (tmp_path / "eagle" / "training.png").is_file()
    engine = eagle_engine(target, again, k=3)  # the trained drafter drafts through the engine
    out = engine.generate([PROMPTS[1]], [SamplingParams(0.0, max_new_tokens=8, ignore_eos=True)])[0]
    assert out.stats.drafted > 0


def test_bfloat16_autocast_trains_in_bf16_and_keeps_float32_weights(tmp_path, target, feats, monkeypatch):
    """``--compute-dtype bfloat16``: the step's forward runs in bf16 (the logits the loss sees are bf16),
    the weights stay float32, the loss still falls; a checkpoint of a float32 run is not resumed in bf16."""
    import specdecode.heads.eagle_train as T

    real, seen = T.eagle_loss, []

    def spy(module, model, batch, settings, gen):
        outs = module(batch["g0"], batch["embs"], batch["positions"], batch["valid"])
        seen.append(outs[0][1].dtype)
        return real(module, model, batch, settings, gen)

    monkeypatch.setattr(T, "eagle_loss", spy)
    model = train_tiny(target, feats, tmp_path / "bf16", compute_dtype="bfloat16")
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    log = json.loads((tmp_path / "bf16" / "train_log.json").read_text())
    assert sum(r[1] for r in log[-5:]) < sum(r[1] for r in log[:5])
    seen.clear()
    train_tiny(target, feats, tmp_path / "f32", epochs=1)
    assert set(seen) == {torch.float32}  # the control: without autocast the forward is float32
    with pytest.raises(F.FeatureError, match="other settings"):
        train_tiny(target, feats, tmp_path / "f32", epochs=1, compute_dtype="bfloat16")
    with pytest.raises(ValueError, match="compute-dtype"):
        train_tiny(target, feats, tmp_path / "bad", compute_dtype="float16")


def test_the_loss_formed_in_slices_of_anchors_equals_the_loss_formed_at_once(monkeypatch):
    """``eagle_loss`` forms float32 log-probabilities ``LOSS_ROWS`` anchor rows at a time (allocator-friendly);
    value and gradient equal the whole-chunk formula, for slices that do and do not divide the chunk."""
    import specdecode.heads.eagle_train as T

    gen = torch.Generator().manual_seed(0)
    b, a, v = 2, 30, 50
    logits = [torch.randn(b, a, v, generator=gen, requires_grad=True) for _ in range(2)]
    levels = [
        {
            "ok": torch.rand(b, a, generator=gen) > 0.1,
            "soft_ids": torch.randint(0, v, (b, a, 8), generator=gen),
            "soft_q": torch.softmax(torch.randn(b, a, 8, generator=gen), -1),
            "hard": torch.where(torch.rand(b, a, generator=gen) > 0.2, torch.randint(0, v, (b, a), generator=gen), -1),
        }
        for _ in logits
    ]
    levels[1]["hard"][:] = -1  # a level without corpus labels
    batch = {"g0": [], "embs": None, "positions": None, "valid": None, "levels": levels}
    model = type("M", (), {"config": type("C", (), {"final_mode": False})()})()
    settings = EagleSettings()

    def whole():
        total = 0
        for j, (lg, lab) in enumerate(zip(logits, levels)):
            logp, ok, h = torch.log_softmax(lg, -1), lab["ok"], lab["hard"] >= 0
            soft = -(lab["soft_q"] * logp.gather(-1, lab["soft_ids"])).sum(-1)[ok].mean()
            hard = -logp.gather(-1, lab["hard"].clamp(min=0)[..., None]).squeeze(-1)[h].mean() if h.any() else 0
            total = total + settings.level_decay**j * (settings.soft_weight * soft + (1 - settings.soft_weight) * hard)
        return total

    want = whole()
    want_grad = torch.autograd.grad(want, logits)
    for rows in (4, 14, 60, 10_000):
        monkeypatch.setattr(T, "LOSS_ROWS", rows)
        got = T.eagle_loss(lambda *_: [(None, lg) for lg in logits], model, batch, settings, None)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got, logits), want_grad):
            torch.testing.assert_close(g, w)


def test_fusion_training_reads_the_named_layers(tmp_path, target, feats):
    model = train_tiny(target, feats, tmp_path / "fusion", layers="1,final", epochs=1)
    assert model.config.feature_layers == ["layer1", "final"] and model.fuse is not None
    with pytest.raises(F.FeatureError, match="--layers 2"):
        train_tiny(target, feats, tmp_path / "nope", layers="2")


def test_training_resumes_after_a_kill_to_the_same_weights(tmp_path, target, feats, monkeypatch):
    whole = train_tiny(target, feats, tmp_path / "whole")
    import specdecode.heads.eagle_train as T

    real = T.eagle_loss
    calls = {"n": 0}

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 8:  # after the checkpoint of step 5
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(T, "eagle_loss", dying)
    with pytest.raises(KeyboardInterrupt):
        train_tiny(target, feats, tmp_path / "resumed")
    monkeypatch.setattr(T, "eagle_loss", real)
    resumed = train_tiny(target, feats, tmp_path / "resumed")
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_eagle3_layers_and_layer_names():
    assert eagle3_layers(28) == [2, 14, 25]
    assert resolve_layers("eagle3", 28) == ["layer2", "layer14", "layer25"]
    assert resolve_layers("final", 2) == ["final"]
    with pytest.raises(ValueError):
        resolve_layers("40", 28)


# -- bad input ------------------------------------------------------------------------------------------
def test_a_drafter_for_another_target_or_layer_set_is_refused(target):
    model = tiny_eagle(target, ("layer1", "final"))
    check_target(model, HFRunner(target), "E")
    with pytest.raises(HeadsError, match="features of size"):
        check_target(model, HFRunner(make_model(V, seed=3, hidden=64)), "E")
    with pytest.raises(HeadsError, match="vocabulary"):
        check_target(model, HFRunner(make_model(V + 8, seed=3, hidden=32)), "E")
    with pytest.raises(HeadsError, match="layers"):
        check_target(model, HFRunner(make_model(V, seed=3, hidden=32, layers=3)), "E")
    with pytest.raises(HeadsError, match="another model"):
        check_target(model, HFRunner(make_model(V, seed=9, hidden=32)), "E")
    with pytest.raises(HeadsError, match="not an EAGLE drafter directory"):
        EagleModel.load("/nonexistent")


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "specdecode.cli", *args], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )


def test_cli_extract_train_generate_round_trip(tmp_path, target):
    model_dir = tmp_path / "model"
    target.save_pretrained(model_dir)
    TOK.save_pretrained(model_dir)
    corpus = write_corpus(tmp_path / "corpus")
    feats, out = tmp_path / "feats", tmp_path / "eagle"
    r = cli(
        "heads",
        "extract",
        "--target",
        str(model_dir),
        "--corpus",
        str(corpus),
        "--out",
        str(feats),
        "--max-tokens",
        "600",
        "--seq-len",
        "48",
        "--shard-tokens",
        "200",
        "--dtype",
        "float32",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    r = cli(
        "heads",
        "train",
        "--kind",
        "eagle",
        "--features",
        str(feats),
        "--out",
        str(out),
        "--draft-vocab",
        "20",
        "--intermediate-size",
        "32",
        "--epochs",
        "1",
        "--batch-chunks",
        "2",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/step" in r.stdout
    for extra in ([], ["--tree-topk", "2", "--tree-nodes", "4"]):
        r = cli(
            "generate",
            "--target",
            str(model_dir),
            "--draft",
            f"eagle:{out}",
            "--prompt",
            "abc",
            "--dtype",
            "float32",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--json",
            *extra,
        )
        assert r.returncode == 0, r.stderr
    for bad, culprit in [
        (
            [
                "generate",
                "--target",
                str(model_dir),
                "--draft",
                f"eagle:{tmp_path}",
                "--prompt",
                "a",
                "--dtype",
                "float32",
            ],
            "EAGLE drafter directory",
        ),
        (["generate", "--target", str(model_dir), "--draft", "eagle", "--prompt", "a"], "eagle:DIR"),
        (
            ["heads", "train", "--kind", "eagle", "--features", str(feats), "--out", str(out), "--eagle-layers", "7"],
            "7",
        ),
    ]:
        r = cli(*bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and culprit in r.stderr, (bad, r.stderr)


def test_training_runs_under_torchrun_with_two_processes(tmp_path, target, feats):
    import shutil

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    model_dir = tmp_path / "model"
    target.save_pretrained(model_dir)
    TOK.save_pretrained(model_dir)
    r = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "specdecode.cli",
            "heads",
            "train",
            "--kind",
            "eagle",
            "--features",
            str(feats),
            "--out",
            str(tmp_path / "ddp"),
            "--target",
            str(model_dir),
            "--draft-vocab",
            "20",
            "--intermediate-size",
            "32",
            "--epochs",
            "1",
            "--batch-chunks",
            "4",
            "--no-progress",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert cfg["training"]["world_size"] == 2
    EagleModel.load(tmp_path / "ddp")
