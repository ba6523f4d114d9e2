"""Medusa heads: extract -> train -> draft on tiny models (no downloads).

Exactness through the engine (greedy equality, the chi-square law of two tokens at ALPHA = 1e-4 per
setting; an untrained or random head is as good a drafter for that as a trained one), typical
acceptance labelled lossy and failed by ``check``, resumable extraction and training, and clean
errors for bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from specdecode.check import CheckConfig, run_check
from specdecode.check.report import FAIL, PASS
from specdecode.config import EngineSettings
from specdecode.drafters.medusa import MedusaDrafter, check_target
from specdecode.engine import Engine
from specdecode.heads import features as F
from specdecode.heads.corpus import CorpusError, documents
from specdecode.heads.train import TrainSettings, train
from specdecode.models.base import FINAL
from specdecode.models.hf import HFRunner
from specdecode.models.medusa import HeadsError, MedusaConfig, MedusaHeads, static_tree
from specdecode.sampling import SamplingParams
from specdecode.verify.typical import typical_verifier, verify_typical
from test_engine import ALPHA, VS, chi_square_p, exact_two_token_law, sample_pairs
from tiny import ALPHABET, make_model, make_tokenizer

# only a guard against a hang: on a busy CI machine a run can take many times its usual tens of seconds
SUBPROCESS_TIMEOUT_S = 1800

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 5, 6]]


def tiny_heads(target, num_heads=3, draft_vocab=None, seed=0, noise=0.5) -> MedusaHeads:
    """Heads for ``target`` with random residual blocks (a poor but valid drafter)."""
    runner = HFRunner(target)
    vocab = runner.vocab_size
    draft_vocab = draft_vocab or vocab - 4
    gen = torch.Generator().manual_seed(seed)
    id_map = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    cfg = MedusaConfig(
        num_heads,
        runner.hidden_size,
        vocab,
        draft_vocab,
        target={"spec": "tiny", "fingerprint": F.model_fingerprint(runner)},
    )
    heads = MedusaHeads(cfg, id_map, target.get_output_embeddings().weight[id_map].detach().float())
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, noise / runner.hidden_size**0.5, generator=gen)
    return heads.eval()


def medusa_engine(target, heads, k=3, topk=1, nodes=0, slots=4, max_len=128, verifier=None):
    drafter = MedusaDrafter(heads, tree_topk=topk, tree_nodes=nodes)
    return Engine(
        HFRunner(target), TOK, drafter, k, EngineSettings(max_batch_size=slots, max_context=max_len), verifier=verifier
    )


@pytest.fixture(scope="module")
def target():
    return make_model(V, seed=3, hidden=32)


# -- drafting --------------------------------------------------------------------------------------------
def test_the_drafter_reads_the_hidden_state_before_the_pending_token(target):
    heads = tiny_heads(target)
    engine = medusa_engine(target, heads, k=3)
    seen = []
    original = engine.drafter.propose

    def spy(seqs, num_tokens):
        prop = original(seqs, num_tokens)
        seen.append((list(seqs[0].token_ids), prop.tokens[0, : int(prop.num_tokens[0])].tolist()))
        return prop

    engine.drafter.propose = spy
    engine.generate([PROMPTS[1]], [SamplingParams(0.0, max_new_tokens=10)])
    assert len(seen) >= 2
    for token_ids, drafted in seen:
        with torch.no_grad():
            h = target(torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
            expect = heads.id_map[heads(h).argmax(-1)].tolist()
        assert drafted == expect


@pytest.mark.parametrize("topk,nodes", [(1, 0), (3, 8)])
def test_greedy_with_medusa_equals_target_only(target, topk, nodes):
    ref = Engine(HFRunner(target), TOK, None, 0, EngineSettings(max_batch_size=4, max_context=128))
    params = [SamplingParams(0.0, max_new_tokens=24, ignore_eos=True) for _ in PROMPTS]
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    engine = medusa_engine(target, tiny_heads(target), k=3, topk=topk, nodes=nodes)
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.drafted for o in outs) > 0


def test_draft_confidence_ends_chains_where_a_head_is_unsure(target):
    heads = tiny_heads(target, noise=2.0)
    ref = Engine(HFRunner(target), TOK, None, 0, EngineSettings(max_batch_size=4, max_context=128))
    params = [SamplingParams(0.0, max_new_tokens=16, ignore_eos=True) for _ in PROMPTS]
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    full = medusa_engine(target, heads, k=3).generate(PROMPTS, params)
    engine = medusa_engine(target, heads, k=3)
    engine.drafter.confidence = 1.5  # above any probability: every head is unsure, one token a step
    short = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in short] == want  # exact either way
    assert all(len(o.stats.drafted_at) <= 1 for o in short)  # never a second draft position
    assert sum(o.stats.drafted for o in short) < sum(o.stats.drafted for o in full)


def test_zero_blocks_draft_the_targets_next_token_so_greedy_accepts_repeats():
    """An untrained head (zero residual) reads like the LM head: a useful sanity anchor."""
    model = make_model(V, seed=5, hidden=32)
    heads = tiny_heads(model, noise=0.0, draft_vocab=V)
    engine = medusa_engine(model, heads, k=3)
    out = engine.generate([[7, 7, 7, 7]], [SamplingParams(0.0, max_new_tokens=12, ignore_eos=True)])[0]
    assert out.stats.drafted > 0


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["t1", "t0.7p0.9"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_medusa_keeps_the_target_law(sp, tree):
    model = make_model(VS, seed=4, hidden=32)
    heads = tiny_heads(model, num_heads=2, draft_vocab=VS - 2, noise=2.0)
    engine = Engine(
        HFRunner(model),
        make_tokenizer(VS),
        MedusaDrafter(heads, tree_topk=3 if tree else 1, tree_nodes=5 if tree else 0),
        2,
        EngineSettings(max_batch_size=50, max_context=32),
    )
    prompt = [1, 2, 3]
    n = 3000
    counts = sample_pairs(engine, prompt, sp, n, batch=50)
    assert chi_square_p(counts, exact_two_token_law(model, prompt, sp), n) > ALPHA


def test_static_tree_takes_the_most_probable_nodes_best_first():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    parents, depths, ranks = static_tree(acc, 5, 3)
    # reach: (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.12 (0,0,0)=.12 -> ties broken by heap order, parents first
    assert list(zip(depths, ranks))[:3] == [(0, 0), (1, 0), (0, 1)]
    assert all(p < i for i, p in enumerate(parents))
    assert static_tree(acc, 100, 2)[1].count(2) == 0  # depth capped
    assert len(static_tree(acc, 100, 3)[0]) == 3 + 9 + 27


# -- typical acceptance: lossy, labelled, caught by check -------------------------------------------------
def test_typical_acceptance_accepts_plausible_tokens_without_rejection_sampling():
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]])
    res = verify_typical(torch.tensor([[1, 2]]), None, probs, torch.tensor([2]), torch.zeros(1, 3))
    assert int(res.num_accepted[0]) == 2  # 0.3 and 0.8 pass min(0.09, ...) whatever the uniforms
    probs[0, 1] = torch.tensor([0.05, 0.15, 0.8])
    res = verify_typical(torch.tensor([[1, 0]]), None, probs, torch.tensor([2]), torch.zeros(1, 3))
    assert int(res.num_accepted[0]) == 1  # 0.05 < min(0.09, 0.3 exp(-H))
    assert res.tokens[0, :2].tolist() == [1, 0]  # then a draw from p itself, no residual: the rejected token again


def test_check_fails_typical_acceptance_and_passes_exact(target):
    heads = tiny_heads(target, noise=0.0, draft_vocab=V)  # drafts the target's own top tokens: typical takes them
    cfg = CheckConfig(num_draft_tokens=3, parts=(1, 2), law_contexts=2, law_samples=1500, e2e_samples=250, e2e_batch=50)

    def factory_for(verifier):
        def factory(k, batch):
            drafter = MedusaDrafter(heads) if k else None
            return Engine(
                HFRunner(target),
                TOK,
                drafter,
                k,
                EngineSettings(max_batch_size=batch, max_context=64),
                verifier=verifier,
            )

        return factory

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    exact = run_check(factory_for(None), prompts, cfg)
    assert {p.part: p.status for p in exact.parts if p.part in (1, 2)} == {1: PASS, 2: PASS}, [
        p.summary for p in exact.parts
    ]
    lossy = run_check(factory_for(typical_verifier()), prompts, cfg)
    assert FAIL in {p.status for p in lossy.parts}, [p.summary for p in lossy.parts]


# -- extraction and training ------------------------------------------------------------------------------
def write_corpus(root, files=16, length=160, seed=0):
    """Letters with structure a head can learn: runs of a repeated short word."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        words = ["".join(rng.choice(ALPHABET[:20]) for _ in range(rng.randint(2, 4))) for _ in range(3)]
        text = "".join(rng.choice(words) for _ in range(length // 3))[:length]
        (root / f"doc{i:02d}.txt").write_text(text)
    return root


SETTINGS = F.ExtractSettings(
    layers=(FINAL,), seq_len=48, max_tokens=900, topk=4, shard_tokens=100, max_doc_tokens=96, min_chunk=8
)


def run_extract(target, corpus, out, settings=SETTINGS):
    docs = documents([str(corpus)])
    return F.extract(HFRunner(target), TOK, docs, out, settings, {"spec": "tiny"}, "fp", progress=False)


def test_extracted_features_are_the_targets_own(tmp_path, target):
    corpus = write_corpus(tmp_path / "corpus")
    manifest = run_extract(target, corpus, tmp_path / "feats")
    fs = F.FeatureSet(tmp_path / "feats")
    assert manifest["complete"] and len(fs) == manifest["tokens"] == 900
    assert oct(os.stat(tmp_path / "feats" / manifest["shards"][0]["file"]).st_mode & 0o044) != "0o0"
    first = fs["chunk"] == 0
    ids = fs["input_ids"][first].long()
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    torch.testing.assert_close(fs["final"][first].float(), out.hidden_states[-1][0], atol=2e-2, rtol=2e-2)
    top = torch.log_softmax(out.logits[0], -1).topk(4, dim=-1)
    assert torch.equal(fs["topk_ids"][first].long(), top.indices)


def test_extraction_resumes_after_a_kill_to_the_same_result(tmp_path, target, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    run_extract(target, corpus, tmp_path / "whole")
    calls = {"n": 0}
    real = F._chunk_features

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(F, "_chunk_features", dying)
    with pytest.raises(KeyboardInterrupt):
        run_extract(target, corpus, tmp_path / "resumed")
    partial = json.loads((tmp_path / "resumed" / F.MANIFEST).read_text())
    assert 0 < partial["tokens"] < 900 and not partial["complete"]
    monkeypatch.setattr(F, "_chunk_features", real)
    run_extract(target, corpus, tmp_path / "resumed")
    a, b = F.FeatureSet(tmp_path / "whole"), F.FeatureSet(tmp_path / "resumed")
    for key in a.tensors:
        assert torch.equal(a[key], b[key]), key


def test_extraction_refuses_another_runs_directory_and_benchmark_prompts(tmp_path, target):
    corpus = write_corpus(tmp_path / "corpus")
    run_extract(target, corpus, tmp_path / "feats")
    with pytest.raises(F.FeatureError, match="another extraction"):
        run_extract(target, corpus, tmp_path / "feats", F.ExtractSettings(seq_len=32, max_tokens=900))
    with pytest.raises(CorpusError, match="evaluation only"):
        documents(["/data/spec_bench/question.jsonl"])
    with pytest.raises(CorpusError, match="no such file"):
        documents([str(tmp_path / "nope")])


def train_tiny(target, feats, out, **kw):
    settings = TrainSettings(**{"num_heads": 2, "draft_vocab": 24, "epochs": 3, "batch_size": 32, "lr": 3e-3, **kw})
    rows = lambda id_map: target.get_output_embeddings().weight[id_map].detach().float().clone()  # noqa: E731
    return train(
        F.FeatureSet(feats), out, settings, "tiny", checkpoint_every=5, evals=3, progress=False, output_rows=rows
    )


@pytest.fixture(scope="module")
def feats(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("medusa")
    run_extract(target, write_corpus(root / "corpus"), root / "feats")
    return root / "feats"


def test_training_lowers_the_loss_and_saved_heads_reload_bit_exact(tmp_path, target, feats):
    heads = train_tiny(target, feats, tmp_path / "heads")
    log = json.loads((tmp_path / "heads" / "train_log.json").read_text())
    first, last = sum(r[1] for r in log[:5]) / 5, sum(r[1] for r in log[-5:]) / 5
    assert last < first
    again = MedusaHeads.load(tmp_path / "heads")
    for key, value in heads.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    cfg = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert len(cfg["accuracy"]) == 2 and cfg["training"]["held_out_positions"] > 0
    assert (tmp_path / "heads" / "training.png").is_file()
    engine = medusa_engine(target, again, k=2)  # trained heads draft through the engine
    out = engine.generate([PROMPTS[1]], [SamplingParams(0.0, max_new_tokens=8, ignore_eos=True)])[0]
    assert out.stats.drafted > 0


def test_bfloat16_autocast_training_lowers_the_loss_with_float32_weights(tmp_path, target, feats):
    heads = train_tiny(target, feats, tmp_path / "bf16", compute_dtype="bfloat16")
    log = json.loads((tmp_path / "bf16" / "train_log.json").read_text())
    assert sum(r[1] for r in log[-5:]) < sum(r[1] for r in log[:5])
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    assert MedusaHeads.load(tmp_path / "bf16").config.training["settings"]["compute_dtype"] == "bfloat16"


def test_training_resumes_after_a_kill_to_the_same_weights(tmp_path, target, feats, monkeypatch):
    whole = train_tiny(target, feats, tmp_path / "whole")
    import specdecode.heads.train as T

    real = T.loss_fn
    calls = {"n": 0}

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 13:  # after the checkpoint of step 10
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(T, "loss_fn", dying)
    with pytest.raises(KeyboardInterrupt):
        train_tiny(target, feats, tmp_path / "resumed")
    assert torch.load(tmp_path / "resumed" / T.CHECKPOINT, weights_only=False)["step"] == 10
    monkeypatch.setattr(T, "loss_fn", real)
    resumed = train_tiny(target, feats, tmp_path / "resumed")
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


# -- bad input ------------------------------------------------------------------------------------------
def test_heads_for_another_target_are_refused(target):
    heads = tiny_heads(target)
    check_target(heads, HFRunner(target), "H")
    with pytest.raises(HeadsError, match="hidden states of size"):
        check_target(heads, HFRunner(make_model(V, seed=3, hidden=64)), "H")
    with pytest.raises(HeadsError, match="vocabulary"):
        check_target(heads, HFRunner(make_model(V + 8, seed=3, hidden=32)), "H")
    with pytest.raises(HeadsError, match="another model"):
        check_target(heads, HFRunner(make_model(V, seed=9, hidden=32)), "H")


def test_corrupted_shard_and_missing_dirs_get_clear_errors(tmp_path, target, feats):
    with pytest.raises(F.FeatureError, match="heads extract"):
        F.FeatureSet(tmp_path / "missing")
    copy = tmp_path / "copy"
    shutil.copytree(feats, copy)
    shard = copy / json.loads((copy / F.MANIFEST).read_text())["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(F.FeatureError, match="corrupted shard"):
        F.FeatureSet(copy)
    with pytest.raises(HeadsError, match="not a heads directory"):
        MedusaHeads.load(tmp_path)


# -- the CLI, in one process and under torchrun ---------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("model")
    target.save_pretrained(root)
    TOK.save_pretrained(root)
    return root


def cli(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "specdecode.cli", *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        **kw,
    )


def test_cli_extract_train_generate_round_trip(tmp_path, model_dir):
    corpus = write_corpus(tmp_path / "corpus")
    feats, heads = tmp_path / "feats", tmp_path / "heads"
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
        "--features",
        str(feats),
        "--out",
        str(heads),
        "--num-heads",
        "2",
        "--draft-vocab",
        "20",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    assert "held-out top-1" in r.stdout
    r = cli(
        "generate",
        "--target",
        str(model_dir),
        "--draft",
        f"medusa:{heads}",
        "--prompt",
        "abc",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["lossy"] is False
    r = cli(
        "generate",
        "--target",
        str(model_dir),
        "--draft",
        f"medusa:{heads}",
        "--prompt",
        "abc",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--temperature",
        "1",
        "--acceptance",
        "typical",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])
    assert out["lossy"] is True and "typical" in out["lossy_because"]["acceptance"]
    for bad, culprit in [
        (["heads", "train", "--features", str(tmp_path / "nope"), "--out", str(heads)], "nope"),
        (
            ["heads", "extract", "--target", str(model_dir), "--corpus", str(tmp_path / "nope"), "--out", str(feats)],
            "nope",
        ),
        (
            [
                "generate",
                "--target",
                str(model_dir),
                "--draft",
                f"medusa:{tmp_path}",
                "--prompt",
                "a",
                "--dtype",
                "float32",
            ],
            "heads directory",
        ),
    ]:
        r = cli(*bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and culprit in r.stderr, (bad, r.stderr)


def test_training_runs_under_torchrun_with_two_processes(tmp_path, feats, model_dir):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    # features of the tiny model saved in model_dir: the manifest names "tiny", so name the target
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
            "--features",
            str(feats),
            "--out",
            str(tmp_path / "ddp"),
            "--target",
            str(model_dir),
            "--num-heads",
            "2",
            "--draft-vocab",
            "20",
            "--epochs",
            "1",
            "--batch-size",
            "32",
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
    MedusaHeads.load(tmp_path / "ddp")


def test_jsonl_corpus_reads_text_and_chat_records_and_names_bad_lines(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text('{"text": "abc"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    docs = documents([str(good)], render_chat=lambda m: "|".join(x["content"] for x in m))
    assert sorted(d.read() for d in docs) == ["abc", "hi"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "abc"}\n{"nope": 1}\n')
    with pytest.raises(CorpusError, match=r"b.jsonl:2"):
        documents([str(bad)])
    bad.write_text('{"text": "abc"}\nnot json\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2: invalid JSON"):
        documents([str(bad)])
