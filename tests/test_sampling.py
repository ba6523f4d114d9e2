import json
import math
from pathlib import Path

import pytest
import torch

from specdecode.sampling import (
    SamplingError,
    SamplingParams,
    SamplingSetting,
    make_generator,
    params_tensors,
    parse_setting,
    sample,
    top_p_threshold,
    warp,
)


def reference_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Slow, obviously-correct single-row warp (temperature, then top-k, then top-p)."""
    if temperature == 0:
        out = torch.zeros_like(logits)
        out[int(logits.argmax())] = 1
        return out
    x = logits.double() / temperature
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    keep = set(order)
    if top_k:
        kth = float(x[order[min(top_k, len(x)) - 1]])
        keep = {i for i in keep if float(x[i]) >= kth}
    if top_p < 1:  # keep a token iff the mass of the tokens strictly more likely than it is below top_p
        probs = torch.softmax(torch.tensor([float(x[i]) if i in keep else -math.inf for i in range(len(x))]), 0)
        ahead = (x[None, :] > x[:, None]).double() @ probs.double()  # [i]: mass strictly more likely than i
        keep = {i for i in keep if float(ahead[i]) < top_p}
    masked = torch.tensor([float(x[i]) if i in keep else -math.inf for i in range(len(x))])
    return torch.softmax(masked, 0).float()


@pytest.mark.parametrize(
    "t,k,p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0), (1.3, 3, 0.8), (0.0, 0, 1.0), (0.5, 50, 0.5)]
)
def test_warp_matches_reference(t, k, p):
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)] * 6
    got = warp(logits, *params_tensors(params))
    for row in range(6):
        torch.testing.assert_close(got[row], reference_warp(logits[row], t, k, p), atol=1e-6, rtol=1e-5)


def nucleus_rows(vocab: int = 3000) -> torch.Tensor:
    """Rows whose nucleus (p = 0.9) is decided by each rung of the ladder: a few tokens, hundreds, most of
    the vocabulary; and rows with ties straddling the cut."""
    g = torch.Generator().manual_seed(0)
    peaky = torch.randn(4, vocab, generator=g) + torch.where(torch.rand(4, vocab, generator=g) < 0.003, 12.0, 0.0)
    medium = torch.randn(4, vocab, generator=g) * 1.5
    flat = torch.randn(4, vocab, generator=g) * 0.1
    ties = torch.full((3, vocab), -12.0)
    ties[:, :3] = torch.tensor([4.0, 2.0, 2.0])  # the cut falls inside the tied pair
    ties[1, 100:400] = 1.0  # a tied group of 300 across the first rung
    ties[2] = ties[2][torch.randperm(vocab, generator=g)]
    return torch.cat([peaky, medium, flat, ties])


def test_top_p_ladder_equals_one_full_sort():
    rows = nucleus_rows()
    p = torch.full((rows.shape[0],), 0.9)
    fast = top_p_threshold(rows, p)
    assert torch.equal(fast, top_p_threshold(rows, p, ladder=()))
    assert torch.equal(fast, top_p_threshold(rows, p, ladder=(16, 64, 256)))
    alone = torch.cat([top_p_threshold(rows[i : i + 1], p[:1]) for i in range(rows.shape[0])])
    assert torch.equal(fast, alone)  # a row's cut does not depend on its batch


def test_top_p_keeps_tied_tokens_together_whatever_their_order():
    rows = nucleus_rows()[-3:]
    params = [SamplingParams(1.0, top_p=0.9)] * 3
    probs = warp(rows, *params_tensors(params))
    for row, got in zip(rows, probs):
        for value in row.unique():
            assert len(got[row == value].unique()) == 1  # kept or dropped as one group
    assert (probs[0] > 0).sum() == 3  # 4.0 alone holds < 0.9: both tokens at 2.0 are kept
    perm = torch.randperm(rows.shape[1])
    permuted = warp(rows[:, perm], *params_tensors(params))
    assert torch.equal(permuted > 0, probs[:, perm] > 0)  # the same tokens kept (sums may round otherwise)
    torch.testing.assert_close(permuted, probs[:, perm])


def test_peaky_rows_never_sort_the_vocabulary(monkeypatch):
    rows = nucleus_rows()[:4]
    p = torch.full((4,), 0.9)
    expected = top_p_threshold(rows, p, ladder=())

    def no_sort(*a, **kw):
        raise AssertionError("a full sort for a row the first rung decides")

    monkeypatch.setattr(torch, "sort", no_sort)
    assert torch.equal(top_p_threshold(rows, p), expected)


@pytest.mark.parametrize("t,p", [(0.7, 0.95), (1.0, 0.5)])
def test_warp_matches_reference_on_a_large_vocabulary(t, p):
    rows = nucleus_rows(vocab=1500)[::2]
    got = warp(rows, *params_tensors([SamplingParams(t, top_p=p)] * rows.shape[0]))
    for row in range(rows.shape[0]):
        torch.testing.assert_close(got[row], reference_warp(rows[row], t, 0, p), atol=1e-6, rtol=1e-5)


def test_warp_mixed_rows_equal_single_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    params = [SamplingParams(0.0), SamplingParams(1.0, top_k=4), SamplingParams(0.8, top_p=0.7), SamplingParams(1.2)]
    batched = warp(logits, *params_tensors(params))
    for i, sp in enumerate(params):
        torch.testing.assert_close(batched[i], warp(logits[i : i + 1], *params_tensors([sp]))[0])


def test_sample_never_returns_zero_probability_tokens_and_follows_cdf():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.25, 0.4999, 0.5, 0.9999])
    assert sample(probs, u).tolist() == [1, 1, 1, 3, 3]


def test_generators_are_reproducible():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(max_new_tokens=0),
        dict(stop=("",)),
        dict(seed="x"),
    ],
)
def test_impossible_arguments_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


# -- settings and their parser -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,fields,name",
    [
        ("greedy", (0.0, 0, 1.0), "greedy"),
        (" Greedy ", (0.0, 0, 1.0), "greedy"),
        # bench style: named by the spec itself (bench records and resumes match on it)
        ("t0.7-p0.95", (0.7, 0, 0.95), "t0.7-p0.95"),
        ("t1.0", (1.0, 0, 1.0), "t1.0"),
        ("t1", (1.0, 0, 1.0), "t1"),
        ("t0.7-p.9", (0.7, 0, 0.9), "t0.7-p.9"),
        ("t1.3-p1", (1.3, 0, 1.0), "t1.3-p1"),
        # check style: named from the fields; t defaults to 1
        ("t=1", (1.0, 0, 1.0), "T=1"),
        ("t=0.7,p=0.9", (0.7, 0, 0.9), "T=0.7 top-p=0.9"),
        ("p=0.9, T=0.7", (0.7, 0, 0.9), "T=0.7 top-p=0.9"),
        ("k=20", (1.0, 20, 1.0), "T=1 top-k=20"),
        ("t=1.3,k=5,p=0.5", (1.3, 5, 0.5), "T=1.3 top-k=5 top-p=0.5"),
        ("t=0", (0.0, 0, 1.0), "greedy"),
    ],
)
def test_parse_setting_reads_both_spellings(spec, fields, name):
    s = parse_setting(spec)
    assert isinstance(s, SamplingSetting)
    assert (s.temperature, s.top_k, s.top_p) == fields
    assert s.name == name
    assert s.greedy == (fields[0] == 0)
    assert s.params(seed=3, max_new_tokens=5) == SamplingParams(*fields, seed=3, max_new_tokens=5)


def test_check_style_settings_compare_equal_to_their_fields():
    assert parse_setting("greedy") == parse_setting("t=0") == SamplingSetting(0.0)
    assert parse_setting("t=0.7,p=0.9") == SamplingSetting(0.7, top_p=0.9)
    assert parse_setting("k=20") == SamplingSetting(1.0, top_k=20)


@pytest.mark.parametrize("bench,check", [("t0.7-p0.95", "t=0.7,p=0.95"), ("t1.0", "t=1"), ("t1.3", "p=1,t=1.3")])
def test_both_spellings_of_one_law_give_the_same_params(bench, check):
    a, b = parse_setting(bench), parse_setting(check)
    assert a.name == bench and b.name != bench  # different names ...
    assert a != b
    assert a.params() == b.params()  # ... the same law
    assert a.params(seed=7, max_new_tokens=9, ignore_eos=True) == b.params(seed=7, max_new_tokens=9, ignore_eos=True)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("hot", "unknown sampling setting 'hot'"),
        ("t", "unknown sampling setting 't'"),
        ("", "unknown sampling setting ''"),
        ("t-1", "unknown sampling setting 't-1'"),
        ("T0.7", "unknown sampling setting 'T0.7'"),
        ("t0.7-k20", "unknown sampling setting 't0.7-k20'"),
        ("t0", "need T > 0 (use 'greedy' for T = 0)"),
        ("t0.7-p1.5", "0 < top_p <= 1"),
        ("t0.7-p0", "0 < top_p <= 1"),
        ("x=3", "bad setting 'x=3': use 'greedy' or t=<temp>,k=<top-k>,p=<top-p>"),
        ("t=0.7,p", "bad setting 't=0.7,p'"),
        ("k=2.5", "bad setting 'k=2.5': k='2.5' is not a number"),
        ("t=hot", "bad setting 't=hot': t='hot' is not a number"),
        ("t=-1", "temperature must be a number in [0, 2]"),
        ("t=nan", "temperature must be a number in [0, 2]"),
        ("t=2.5", "temperature must be a number in [0, 2]"),
        ("p=0", "top_p must be a number in (0, 1]"),
        ("k=-1", "top_k must be an integer >= 0"),
    ],
)
def test_bad_setting_specs_name_the_problem(spec, message):
    with pytest.raises(SamplingError) as info:
        parse_setting(spec)
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)


def test_settings_are_validated_through_sampling_params():
    for kwargs in (
        dict(temperature=-1.0),
        dict(temperature=1.0, top_k=-1),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=1.0, label=""),
        dict(temperature=1.0, label=3),
    ):
        with pytest.raises(SamplingError):
            SamplingSetting(**kwargs)
    assert SamplingSetting(0.7, label="mine").name == "mine"
    assert SamplingSetting(1.0, 20, 0.9).name == "T=1 top-k=20 top-p=0.9"
    assert hash(parse_setting("t0.7-p0.95")) == hash(parse_setting("t0.7-p0.95"))


def test_stored_bench_results_keep_their_setting_names():
    """Bench results key runs by the setting's name: every name in the committed results still parses to itself."""
    files = sorted((Path(__file__).parent.parent / "docs" / "bench").glob("*/results.json"))
    if not files:
        pytest.skip("no stored bench results")
    names = set()
    for path in files:
        results = json.loads(path.read_text(encoding="utf-8"))
        names.update(results["meta"]["settings"]["sampling"])
        names.update(r["sampling"] for r in results["records"] if "sampling" in r)
    assert "t0.7-p0.95" in names
    for name in names:
        assert parse_setting(name).name == name
