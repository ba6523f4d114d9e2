import math

import pytest
import torch

from specdecode.sampling import SamplingError, SamplingParams, make_generator, params_tensors, sample, warp


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
    if top_p < 1:
        probs = torch.softmax(torch.tensor([float(x[i]) if i in keep else -math.inf for i in range(len(x))]), 0)
        kept, mass = set(), 0.0
        for i in order:
            if i in keep and mass < top_p:
                kept.add(i)
                mass += float(probs[i])
        keep = kept
    masked = torch.tensor([float(x[i]) if i in keep else -math.inf for i in range(len(x))])
    return torch.softmax(masked, 0).float()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0), (1.3, 3, 0.8), (0.0, 0, 1.0), (0.5, 50, 0.5)])
def test_warp_matches_reference(t, k, p):
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)] * 6
    got = warp(logits, *params_tensors(params))
    for row in range(6):
        torch.testing.assert_close(got[row], reference_warp(logits[row], t, k, p), atol=1e-6, rtol=1e-5)


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
    [dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0.0),
     dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5), dict(max_new_tokens=0), dict(stop=("",)), dict(seed="x")],
)
def test_impossible_arguments_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)
