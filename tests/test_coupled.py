"""The coupled sampler (``--sampler coupled``, specdecode/verify/coupled.py) on tiny models.

* Seeded equality: coupled speculative output equals coupled target-only output token for token, for a
  draft model, n-gram lookup, the suffix drafter, Medusa heads and an EAGLE layer (chains and trees),
  k in {2, 4, 8}, batch 1 and a batch of mixed requests, float32 and bf16 in batch-invariant mode. An
  equality, not a statistical test; each case asserts that drafts were made, accepted and rejected.
* Law: chi-square of the first two tokens over 4000 seeds against the target's warped law, at
  ALPHA = 1e-4 per test (a correct engine fails with at most that probability), with two negative
  controls that must fail: a verifier accepting every draft token, and noise not keyed by the seed.
* The noise: a function of (seed, position) alone; its coupled choice samples the law (chi-square).
* The server's per-request ``sampler`` (and a 400 for a bad one); ``--sampler`` on the command line.
"""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chisquare

from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams, coupled_choice, coupling_key, race_noise, race_noises
from specdecode.verify import Verifier, verify_coupled, verify_tree_coupled
from test_eagle import tiny_eagle
from test_engine import ALPHA, VS, chi_square_p, exact_two_token_law, sample_pairs
from test_medusa import tiny_heads
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 3, 3, 3], [20, 21, 22, 23, 20, 21, 22, 5, 6]]


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=0)
    return target, perturbed_copy(target, noise=0.4)  # close enough to accept often, far enough to reject


def coupled(seed: int, max_new: int = 24, temperature: float = 0.9, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_new_tokens=max_new, ignore_eos=True, sampler="coupled", **kw
    )


MIXED = [
    coupled(11),
    coupled(12, 17, 1.3),
    coupled(13, 30, top_k=5),
    coupled(14, 9, 0.7, top_p=0.9),
    SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, sampler="coupled"),
]


def reference(target, prompts, params) -> list[list[int]]:
    """Each request alone through coupled target-only decoding."""
    engine = make_engine(target, TOK, num_slots=1)
    return [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def assert_trees_when_asked(outs, nodes: int):
    """A tree step verifies more nodes than its depth; a chain verifies exactly its draft."""
    assert (sum(o.stats.nodes for o in outs) > sum(o.stats.drafted for o in outs)) == (nodes > 0)


def assert_equal_and_exercised(outs, ref):
    assert [o.token_ids for o in outs] == ref
    drafted, accepted = sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)
    assert drafted > 0 and 0 < accepted < drafted  # drafts were accepted and rejected


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("slots", [1, 3])
def test_draft_model_chains_equal_target_only(pair, k, slots):
    target, draft = pair
    ref = reference(target, PROMPTS, MIXED)
    outs = make_engine(target, TOK, draft, k=k, num_slots=slots).generate(PROMPTS, MIXED)  # 3 slots: ragged
    assert_equal_and_exercised(outs, ref)


def test_negative_control_the_rejection_sampler_depends_on_the_drafter(pair):
    """The equality above is not vacuous: the same seeds through rejection sampling give other tokens
    with a draft than without one."""
    target, draft = pair
    params = [
        SamplingParams(
            p.temperature,
            p.top_k,
            p.top_p,
            seed=p.seed,
            max_new_tokens=p.max_new_tokens,
            ignore_eos=True,
            sampler="rejection",
        )
        for p in MIXED[:4]
    ]
    ref = reference(target, PROMPTS[:4], params)
    outs = make_engine(target, TOK, draft, k=4, num_slots=1).generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outs] != ref


def test_seeded_output_does_not_depend_on_the_rest_of_the_batch_or_a_rejection_sampled_neighbour(pair):
    target, draft = pair
    ref = reference(target, PROMPTS, MIXED)
    rejection = SamplingParams(temperature=1.0, seed=5, max_new_tokens=20, ignore_eos=True, sampler="rejection")
    engine = make_engine(target, TOK, draft, k=4, num_slots=4)
    outs = engine.generate([[7, 7]] + PROMPTS + [[9]], [rejection] + MIXED + [coupled(None)])
    assert [o.token_ids for o in outs[1:-1]] == ref


def test_engine_default_sampler_and_unseeded_requests(pair):
    target, draft = pair
    params = [SamplingParams(temperature=0.9, seed=s, max_new_tokens=16, ignore_eos=True) for s in (1, 2)]
    ref = reference(target, PROMPTS[:2], [coupled(1, 16), coupled(2, 16)])
    engine = make_engine(target, TOK, draft, k=3, num_slots=2, sampler="coupled")
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], params)] == ref
    seq = engine.add([1, 2], SamplingParams(temperature=1.0))  # unseeded: a random seed keys its noise
    assert seq.params.sampler == "coupled" and seq.params.seed is not None
    engine.abort(seq)
    with pytest.raises(ValueError, match="sampler"):
        make_engine(target, TOK, sampler="gumbel")


@pytest.mark.parametrize("k", [2, 4, 8])
def test_ngram_chains_equal_target_only(pair, k):
    target, _ = pair
    prompts = [p * 3 for p in PROMPTS]  # repeats give lookup something to find
    params = [coupled(20 + i, 30, 0.5) for i in range(len(prompts))]
    engine = Engine(HFRunner(target), TOK, NgramDrafter(), k, EngineSettings(max_batch_size=3, max_context=128))
    assert_equal_and_exercised(engine.generate(prompts, params), reference(target, prompts, params))


@pytest.mark.parametrize("topk,nodes", [(2, 6), (3, 12)])
def test_draft_model_trees_equal_target_only(pair, topk, nodes):
    target, draft = pair
    drafter = DraftModelDrafter(HFRunner(draft), tree_topk=topk, tree_nodes=nodes)
    engine = Engine(
        HFRunner(target), TOK, drafter, 4, EngineSettings(max_batch_size=3, max_context=128, max_tree_nodes=nodes)
    )
    outs = engine.generate(PROMPTS, MIXED)
    assert_equal_and_exercised(outs, reference(target, PROMPTS, MIXED))
    assert_trees_when_asked(outs, nodes)


def test_ngram_trees_equal_target_only(pair):
    target, _ = pair
    prompts = [p * 3 for p in PROMPTS]
    params = [coupled(40 + i, 30, 0.5) for i in range(len(prompts))]
    engine = Engine(
        HFRunner(target),
        TOK,
        NgramDrafter(tree_topk=3, tree_nodes=8),
        4,
        EngineSettings(max_batch_size=2, max_context=128, max_tree_nodes=8),
    )
    assert_equal_and_exercised(engine.generate(prompts, params), reference(target, prompts, params))


@pytest.mark.parametrize("topk,nodes", [(1, 0), (2, 6)], ids=["chain", "tree"])
def test_suffix_drafts_equal_target_only(pair, topk, nodes):
    """The suffix drafter proposes point masses (no law): coupling accepts what the target's noise picks."""
    target, _ = pair
    prompts = [p * 3 for p in PROMPTS]
    params = [coupled(60 + i, 30, 0.5) for i in range(len(prompts))]
    engine = Engine(
        HFRunner(target),
        TOK,
        SuffixDrafter(tree_topk=topk, tree_nodes=nodes),
        4,
        EngineSettings(max_batch_size=3, max_context=128, max_tree_nodes=nodes),
    )
    outs = engine.generate(prompts, params)
    assert_equal_and_exercised(outs, reference(target, prompts, params))
    assert_trees_when_asked(outs, nodes)


@pytest.fixture(scope="module")
def head_target():
    return make_model(V, seed=3, hidden=32)  # the heads' tests' target (hidden state the heads read)


@pytest.mark.parametrize("topk,nodes", [(1, 0), (3, 8)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_equal_target_only(head_target, kind, topk, nodes):
    """Medusa heads and an EAGLE layer draft from the target's own features; the text stays target-only's."""
    if kind == "medusa":
        drafter = MedusaDrafter(tiny_heads(head_target), tree_topk=topk, tree_nodes=nodes)
    else:
        drafter = EagleDrafter(tiny_eagle(head_target), HFRunner(head_target), tree_topk=topk, tree_nodes=nodes)
    params = [coupled(80 + i, 24, 0.6) for i in range(len(PROMPTS))] + [coupled(90, 20, 0.9, top_k=6)]
    prompts = PROMPTS + [[5, 6, 7]]
    engine = Engine(
        HFRunner(head_target), TOK, drafter, 3, EngineSettings(max_batch_size=3, max_context=128, max_tree_nodes=nodes)
    )
    outs = engine.generate(prompts, params)
    assert_equal_and_exercised(outs, reference(head_target, prompts, params))
    assert_trees_when_asked(outs, nodes)


def test_bf16_batch_invariant_chains_equal_target_only_bit_for_bit():
    from specdecode.models import batch_invariant as bi

    vocab = 64
    target = make_model(vocab, seed=7, layers=2, hidden=128, dtype=torch.bfloat16)
    draft = perturbed_copy(target, noise=0.3)
    for model in (target, draft):
        bi.enable(model)
    tok = make_tokenizer(vocab)
    prompts = [[3, 4, 5, 6, 7] * 3, [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21]]
    params = [coupled(100 + i, 40) for i in range(len(prompts))]
    alone = make_engine(target, tok, num_slots=1, max_len=256)
    assert alone.target.batch_invariant
    ref = [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    outs = make_engine(target, tok, draft, k=3, num_slots=4, max_len=256).generate(prompts, params)
    assert_equal_and_exercised(outs, ref)


# -- the law ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_pair():
    target = make_model(VS, seed=5, scale=0.5)
    return target, perturbed_copy(target, noise=0.6, seed=3)


LAW_SETTINGS = [
    SamplingParams(1.0, sampler="coupled"),
    SamplingParams(0.7, top_p=0.9, sampler="coupled"),
    SamplingParams(1.0, top_k=5, sampler="coupled"),
]


def _coupled_pairs(engine, sp, n=4000):
    """First two tokens of ``n`` seeded requests (``sample_pairs`` keeps ``sp``'s law, not its sampler)."""
    counts = torch.zeros(VS, VS)
    for start in range(0, n, 250):
        params = [
            SamplingParams(
                sp.temperature, sp.top_k, sp.top_p, seed=start + i, max_new_tokens=2, ignore_eos=True, sampler="coupled"
            )
            for i in range(250)
        ]
        for out in engine.generate([[1, 2, 3]] * 250, params):
            counts[out.token_ids[0], out.token_ids[1]] += 1
    return counts


@pytest.mark.parametrize("sp", LAW_SETTINGS, ids=["T1", "T0.7-p0.9", "k5"])
def test_coupled_speculative_samples_follow_target_law(small_pair, sp):
    """Chi-square GOF of the first two tokens (the first step drafts one token, so acceptance and the
    corrected token both feed them) vs the exact target law; false alarm <= ALPHA per setting."""
    target, draft = small_pair
    engine = make_engine(target, make_tokenizer(VS), draft, k=3, num_slots=250, max_len=8)
    counts = _coupled_pairs(engine, sp)
    assert chi_square_p(counts, exact_two_token_law(target, [1, 2, 3], sp), 4000) > ALPHA
    assert sample_pairs  # (the rejection sampler's own law tests live in test_engine.py)


def _accept_all(draft_tokens, target_probs, noise, num_draft):
    res = verify_coupled(draft_tokens, target_probs, noise, num_draft)
    rows = torch.arange(len(num_draft))
    choice = coupled_choice(target_probs, noise)
    tokens = torch.cat([draft_tokens, choice[:, -1:]], dim=1)
    tokens[rows, num_draft] = choice[rows, num_draft]
    return type(res)(tokens, num_draft.clone())


def _unkeyed(draft_tokens, target_probs, noise, num_draft):  # every row the noise of row 0's seed
    return verify_coupled(draft_tokens, target_probs, noise[:1].expand_as(noise), num_draft)


@pytest.mark.parametrize("wrong", [_accept_all, _unkeyed], ids=["accept-every-draft", "noise-not-keyed-by-seed"])
def test_negative_controls_fail_the_law_test(small_pair, wrong):
    target, draft = small_pair
    sp = LAW_SETTINGS[0]
    engine = make_engine(
        target, make_tokenizer(VS), draft, k=3, num_slots=250, max_len=8, verifier=Verifier(coupled=wrong)
    )
    counts = _coupled_pairs(engine, sp)
    assert chi_square_p(counts, exact_two_token_law(target, [1, 2, 3], sp), 4000) < ALPHA


# -- the noise and the pure verifiers ------------------------------------------------------------
def test_noise_is_a_function_of_seed_and_position_alone():
    a = race_noise(7, 100, 1000).clone()
    assert torch.equal(a, race_noise(7, 100, 1000))
    assert torch.equal(race_noises(7, 99, 3, 1000)[1], a)
    assert not torch.equal(a, race_noise(8, 100, 1000)) and not torch.equal(a, race_noise(7, 101, 1000))
    assert coupling_key(7, 100) == coupling_key(7, 100) != coupling_key(100, 7)
    # a documented value: the same on every platform (blake2b, then torch's CPU Mersenne Twister)
    assert (
        coupling_key(0, 0)
        == int.from_bytes(__import__("hashlib").blake2b(bytes(24), digest_size=8).digest(), "little") >> 1
    )
    big = race_noise(1, 1, 200_000).double()
    assert abs(float(big.mean()) - 1.0) < 0.02 and float(big.min()) >= 0  # Exp(1)


def test_coupled_choice_samples_the_law():
    """Pure: over 20000 seeds, argmax(probs / E) follows probs (chi-square, false alarm <= 1e-4), and a
    choice that ignores the seed does not."""
    probs = torch.softmax(torch.randn(12, generator=torch.Generator().manual_seed(0)) * 1.5, -1)
    probs[3] = 0.0
    probs /= probs.sum()
    n = 20000
    noise = torch.stack([race_noise(s, 5, 12) for s in range(n)])
    counts = torch.bincount(coupled_choice(probs.expand(n, -1), noise), minlength=12).double()
    assert counts[3] == 0
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * n
    assert chisquare(counts[keep], expected).pvalue > 1e-4
    same = torch.bincount(coupled_choice(probs.expand(n, -1), noise[:1].expand(n, -1)), minlength=12).double()
    assert chisquare(same[keep], expected).pvalue < 1e-4


def test_pure_verifiers_accept_exactly_the_target_choices():
    vocab, k = 16, 4
    target_probs = torch.softmax(torch.randn(2, k + 1, vocab, generator=torch.Generator().manual_seed(1)), -1)
    noise = torch.stack([race_noises(s, 10, k + 1, vocab) for s in (1, 2)])
    choice = coupled_choice(target_probs, noise)  # [2, k+1]
    drafts = choice[:, :k].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % vocab  # row 1 mismatches at its third token
    res = verify_coupled(drafts, target_probs, noise, torch.tensor([k, k]))
    assert res.num_accepted.tolist() == [k, 2]
    assert res.tokens[0].tolist() == choice[0].tolist() and res.tokens[1, :3].tolist() == choice[1, :3].tolist()
    # a tree: two children of the root (a wrong one first), then the chain under the right one
    tokens = torch.tensor([[int(choice[0, 0]) ^ 1, int(choice[0, 0]), int(choice[0, 1])]])
    parents = torch.tensor([[-1, -1, 1]])
    depth = torch.tensor([[0, 1, 1, 2]])
    probs = target_probs[:1, [0, 1, 1, 2]]  # the target's law after each query (by its depth here)
    tree = verify_tree_coupled(tokens, parents, torch.tensor([3]), probs, noise[:1, :3], depth)
    assert tree.num_accepted.tolist() == [2] and tree.path[0].tolist() == [0, 2, 3]
    assert tree.tokens[0].tolist() == choice[0, :3].tolist()


# -- server and command line ---------------------------------------------------------------------
def test_server_per_request_sampler_and_bad_value():
    from test_server_harness import engine, pair as server_pair, serve, tokenizer

    target, _ = server_pair()
    prompt = tokenizer()("abc").input_ids
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0.9, "seed": 3, "ignore_eos": True}
    want = make_engine(target, tokenizer(), num_slots=1).generate(
        [prompt], SamplingParams(0.9, seed=3, max_new_tokens=20, ignore_eos=True, sampler="coupled")
    )[0]
    with serve(engine(k=3, slots=2)) as srv, srv.http() as c:
        r = c.post("/v1/completions", json=body | {"sampler": "coupled"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["speculation"]["drafted"] > 0
        r = c.post("/v1/completions", json=body | {"sampler": "rejection"})
        assert r.status_code == 200, r.text
        r = c.post(
            "/v1/completions",
            content=json.dumps(body | {"sampler": "gumbel"}),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampler"


def test_cli_sampler_flag(tmp_path, capsys):
    from specdecode.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--target", str(tmp_path), "--prompt", "a", "--sampler", "gumbel"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--sampler" in err and len(err.strip().splitlines()) == 1
    from specdecode.build import ConfigError, EngineConfig, validate_config

    with pytest.raises(ConfigError, match="typical"):
        validate_config(EngineConfig("t", "ngram", sampler="coupled", acceptance="typical"))


# -- specdecode check, part 6 --------------------------------------------------------------------
CHECK_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [10, 11], [20, 21, 22, 23]]


def _check(pair, verifier=None):
    from specdecode.check import CheckConfig, run_check

    target, draft = pair

    def factory(k: int, batch: int) -> Engine:
        drafter = DraftModelDrafter(HFRunner(draft)) if k else None
        return Engine(
            HFRunner(target), TOK, drafter, k, EngineSettings(max_batch_size=batch, max_context=64), verifier=verifier
        )

    cfg = CheckConfig(
        num_draft_tokens=3, parts=(6,), law_contexts=2, coupled_tokens=12, greedy_batch=3, coupled_samples=1500
    )
    return run_check(factory, CHECK_PROMPTS, cfg).parts[5]


def test_check_part_6_passes_a_correct_engine(pair):
    part = _check(pair)
    assert part.status == "PASS", part.summary
    eq = part.details["equality"]
    assert eq["accepted"] > 0 and len(eq["comparisons"]) == 3 * (4 + 4)
    assert all(r["acceptance"] <= r["rejection_acceptance"] + 0.05 for r in part.details["law"]["records"])


def test_check_part_6_fails_a_verifier_accepting_every_draft(pair):
    part = _check(pair, Verifier(coupled=_accept_all))
    assert part.status == "FAIL" and "differ from target-only" in part.summary and "law tests rejected" in part.summary


def test_check_cli_parts_default_to_six_with_the_coupled_sampler():
    import argparse

    from specdecode.build import add_model_arguments
    from specdecode.check import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--target", "t", "--draft", "d", "--sampler", "coupled"])
    assert cli.config_from_args(args).parts == (1, 2, 3, 4, 5, 6)
    assert cli.config_from_args(parser.parse_args(["--target", "t", "--draft", "d"])).parts == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="coupled-draft-lengths"):
        cli.config_from_args(parser.parse_args(["--target", "t", "--draft", "d", "--coupled-draft-lengths", "0"]))
    assert add_model_arguments
