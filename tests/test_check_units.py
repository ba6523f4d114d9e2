"""Units of `specdecode check`: the statistical tests (including their false-alarm rate), settings
parsing, prefill reuse, and the command line (on tiny models, load_pair patched)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from specdecode.check import cli
from specdecode.check.common import parse_settings
from specdecode.check.prefix import reuse_prefills
from specdecode.check.stats import goodness_of_fit, two_sample
from specdecode.sampling import SamplingParams, SamplingSetting
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _law(rng, cells=20):
    p = rng.dirichlet(np.ones(cells))
    return np.concatenate([p, np.zeros(5)])  # a few impossible tokens


# -- statistics ------------------------------------------------------------------------------------


def test_goodness_of_fit_accepts_the_law_and_rejects_another():
    rng = np.random.default_rng(0)
    p, q = _law(rng), _law(rng)
    assert not goodness_of_fit(rng.choice(len(p), 3000, p=p), p, 1e-4).rejected
    assert goodness_of_fit(rng.choice(len(q), 3000, p=q), p, 1e-4).rejected


def test_goodness_of_fit_rejects_any_impossible_token():
    p = np.array([0.5, 0.5, 0.0])
    res = goodness_of_fit(np.array([0] * 50 + [1] * 50 + [2]), p, 1e-12)
    assert res.rejected and res.impossible == 1


def test_goodness_of_fit_false_alarm_rate_is_at_most_the_level():
    """400 tests of true nulls at level 0.05 (some cells merged): the rejection rate stays near 5%."""
    rng = np.random.default_rng(1)
    p = np.concatenate([rng.dirichlet(np.ones(8)) * 0.9, np.full(40, 0.1 / 40)])  # a tail to merge
    rejections = sum(goodness_of_fit(rng.choice(len(p), 300, p=p), p, 0.05).rejected for _ in range(400))
    assert rejections / 400 <= 0.09


def test_two_sample_false_alarm_rate_and_power():
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(6))

    def tuples(law, n):
        return [tuple(x) for x in rng.choice(len(law), (n, 2), p=law)]

    rejections = sum(two_sample(tuples(p, 200), tuples(p, 200), 0.05)[0].rejected for _ in range(300))
    assert rejections / 300 <= 0.09
    q = np.roll(p, 1)
    assert two_sample(tuples(p, 400), tuples(q, 400), 1e-4)[0].rejected


def test_two_sample_coarsens_sparse_tuples_to_their_prefixes():
    a = [(1, i) for i in range(40)] + [(2, 0)] * 30
    b = [(1, i + 100) for i in range(40)] + [(2, 0)] * 30
    res, table = two_sample(a, b, 1e-3)
    cells = {row[0]: (row[1], row[2]) for row in table}
    assert cells[(1,)] == (40, 40) and cells[(2, 0)] == (30, 30)
    assert not res.rejected and res.cells == 2


# -- settings --------------------------------------------------------------------------------------


def test_parse_settings():
    assert parse_settings("greedy; t=0.7,p=0.9 ;k=20") == (
        SamplingSetting(0.0),
        SamplingSetting(0.7, 0, 0.9),
        SamplingSetting(1.0, 20, 1.0),
    )
    assert SamplingSetting(0.7, 0, 0.9).name == "T=0.7 top-p=0.9"
    for bad in ("t=-1", "x=3", "t", ""):
        with pytest.raises(ValueError):
            parse_settings(bad)


# -- prefill reuse ---------------------------------------------------------------------------------


def test_reused_prefills_give_the_same_outputs_and_are_reused():
    tok = make_tokenizer(V)
    target = make_model(V, seed=0)
    draft = perturbed_copy(target, 0.1)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4]]
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=8) for s in (1, 2, 3)]
    plain = make_engine(target, tok, draft, k=3, num_slots=3).generate(prompts, params)
    engine = make_engine(target, tok, draft, k=3, num_slots=3)
    store = reuse_prefills(engine)
    calls = []
    compute = engine.target.prefill.compute
    engine.target.prefill.compute = lambda slots, ps, layers=(): (calls.append(len(slots)), compute(slots, ps, layers))[
        1
    ]
    for _ in range(2):
        reused = engine.generate(prompts, params)
        assert [o.token_ids for o in reused] == [o.token_ids for o in plain]
    assert calls == [2]  # two distinct prompts, computed once, then copied
    assert len(store) == 4  # (target, draft) x 2 prompts


# -- command line ----------------------------------------------------------------------------------


@pytest.fixture
def tiny_pair(monkeypatch):
    import specdecode.build as build

    target = make_model(V, seed=5, scale=0.5)
    from specdecode.models.backends.pytorch import TorchModel

    pair = build.LoadedPair(
        TorchModel.wrap(target, make_tokenizer(V)),
        TorchModel.wrap(perturbed_copy(target, 0.3, seed=3), make_tokenizer(V)),
    )
    monkeypatch.setattr(build, "load_pair", lambda *args, **kwargs: pair)
    return pair


def _args(tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("abcab", "hello", "dcba", "zzyx")))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(
        [
            "--target",
            "t",
            "--draft",
            "d",
            "--dtype",
            "float32",
            "--prompts",
            str(prompts),
            "-k",
            "3",
            "--law-samples",
            "1000",
            "--law-contexts",
            "2",
            "--e2e-samples",
            "150",
            "--e2e-batch",
            "50",
            "--greedy-tokens",
            "10",
            "--no-progress",
            *extra,
        ]
    )


def test_cli_passes_and_writes_the_evidence(tiny_pair, tmp_path, capsys):
    out = tmp_path / "check.json"
    assert cli.main(_args(tmp_path, "--json", str(out))) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and [p["status"] for p in report["parts"]] == ["PASS"] * 5
    assert report["config"]["law_samples"] == 1000 and report["meta"]["num_draft_tokens"] == 3
    text = capsys.readouterr().out
    assert "verifier law" in text and "overall" in text


def test_cli_exit_code_is_1_when_a_part_fails(tiny_pair, tmp_path, monkeypatch):
    from specdecode.sampling import sample
    from specdecode.verify import verify_speculative

    def skip_residual(draft_tokens, draft_probs, target_probs, num_draft, uniforms):
        res = verify_speculative(draft_tokens, draft_probs, target_probs, num_draft, uniforms)
        rows = torch.arange(len(num_draft))
        res.tokens[rows, res.num_accepted] = sample(target_probs[rows, res.num_accepted], uniforms[:, -1])
        return res

    from specdecode import build
    from specdecode.verify import Verifier

    real = build.engine_from_pair

    def faulty_engine(pair, cfg):
        engine = real(pair, cfg)
        engine.verifier = Verifier(speculative=skip_residual)
        return engine

    monkeypatch.setattr(build, "engine_from_pair", faulty_engine)
    assert cli.main(_args(tmp_path, "--parts", "1")) == 1


def test_cli_bad_flags_exit_2(tiny_pair, tmp_path, capsys):
    assert cli.main(_args(tmp_path, "--parts", "1,9")) == 2
    assert "--parts" in capsys.readouterr().err
    assert cli.main(_args(tmp_path, "--law-settings", "t=0.5,q=2")) == 2


def test_a_stop_string_never_ends_inside_an_incomplete_character():
    """A prefix decoded mid-character ends in U+FFFD, which the next token replaces: the engine holds that
    text back, so no stop string may be chosen from it (it would be judged at the wrong token)."""
    from specdecode.check.stops import _stop_string

    texts = ["a", "ab", "ab\ufffd", "abé"]
    assert _stop_string(texts, 2) is None
    assert _stop_string(texts, 3) == "é" and _stop_string(texts, 1) == "b"


def test_prefills_are_reused_only_where_snapshots_restore_exactly():
    target = make_model(V, seed=5)
    engine = make_engine(target, make_tokenizer(V), perturbed_copy(target, 0.3), k=3)
    engine.target.kv_snapshots_exact = False  # as llama.cpp's runner says of itself
    own = engine.target.prefill
    reuse_prefills(engine)
    assert engine.target.prefill == own and type(engine.runners()["draft"].prefill).__name__ == "_ReusingPrefill"
