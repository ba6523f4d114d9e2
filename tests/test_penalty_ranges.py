"""Every sampling parameter has a range at the cause (issue 59, finding 7): ``SamplingParams`` checks it once for
the library, the command line and the server, and inside it no value makes a probability or a logprob
non-finite. A ``repetition_penalty`` of 1e-39 passed the old "> 0" check: sampled requests were a 500
(NonFiniteProbabilities), greedy ones a 200 with every logprob -9999.0. Here each bound is swept, sampled and
greedy, through the pure functions (logits as large as the bound allows) and the real server."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.logprobs import REPORTED_FLOOR, law_logprobs
from specdecode.processors import apply_all, build_processors
from specdecode.sampling import (
    LOGIT_BIAS_MAX,
    PENALTY_MAX,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_MAX,
    SamplingError,
    SamplingParams,
    warp,
    warp_tensors,
)
from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import V, engine, serve

TINY = 5e-324  # the smallest positive double
# each field's values just outside its range (the server and the library refuse them, naming the field)
OUTSIDE = {
    "temperature": [-1e-9, math.nextafter(TEMPERATURE_MAX, math.inf), 1e39, math.inf, math.nan],
    "top_p": [0.0, -TINY, math.nextafter(1.0, 2.0), math.nan],
    "min_p": [-TINY, math.nextafter(1.0, 2.0), math.inf],
    "presence_penalty": [math.nextafter(PENALTY_MAX, 3.0), -3.0, math.nan],
    "frequency_penalty": [math.nextafter(-PENALTY_MAX, -3.0), 2.5, -math.inf],
    "repetition_penalty": [
        1e-39,
        TINY,
        0.0,
        -1.0,
        math.nextafter(REPETITION_PENALTY_MIN, 0.0),
        math.nextafter(REPETITION_PENALTY_MAX, 3.0),
        1e30,
        math.inf,
    ],
}
# in range, at the bounds: each alone, then all of them pushing the same way
EDGES = [
    {"repetition_penalty": REPETITION_PENALTY_MIN},
    {"repetition_penalty": REPETITION_PENALTY_MAX},
    {"presence_penalty": -PENALTY_MAX, "frequency_penalty": -PENALTY_MAX},
    {"presence_penalty": PENALTY_MAX, "frequency_penalty": PENALTY_MAX},
    {"logit_bias": {t: LOGIT_BIAS_MAX for t in range(3)}},
    {"logit_bias": {t: -LOGIT_BIAS_MAX for t in range(V)}},
    {"top_p": TINY},
    {"min_p": 1.0},
    {"min_p": TINY},
    {"top_k": 1},
    {"top_k": 2**63 - 1},
    {
        "repetition_penalty": REPETITION_PENALTY_MIN,
        "logit_bias": {t: LOGIT_BIAS_MAX for t in range(V // 2)},
        "presence_penalty": -PENALTY_MAX,
        "frequency_penalty": -PENALTY_MAX,
        "min_p": TINY,
        "top_p": TINY,
    },
    {
        "repetition_penalty": REPETITION_PENALTY_MAX,
        "logit_bias": {t: -LOGIT_BIAS_MAX for t in range(V // 2)},
        "presence_penalty": PENALTY_MAX,
        "frequency_penalty": PENALTY_MAX,
    },
]
TEMPERATURES = [0.0, 1e-5, 1.0, TEMPERATURE_MAX]  # greedy, the smallest sampled one, 1, the largest


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in OUTSIDE.items() for v in vs])
def test_a_value_outside_its_range_is_refused_naming_the_field(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**({"temperature": 1.0} | {field: value}))
    assert info.value.param == field and field in str(info.value)


def test_logit_bias_and_seed_ranges_name_their_field():
    for bad in ({1: math.nextafter(LOGIT_BIAS_MAX, 200.0)}, {1: -1e39}, {1: math.nan}):
        with pytest.raises(SamplingError) as info:
            SamplingParams(1.0, logit_bias=bad)
        assert info.value.param == "logit_bias"
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(SamplingError) as info:
            SamplingParams(1.0, seed=seed)
        assert info.value.param == "seed"
    SamplingParams(1.0, seed=2**64 - 1), SamplingParams(1.0, seed=-(2**63))  # the bounds themselves pass


def _edge_params(edge: dict, temperature: float) -> SamplingParams:
    return SamplingParams(temperature, max_new_tokens=4, logprobs=5, **edge)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("edge", EDGES, ids=[",".join(e) for e in EDGES])
@pytest.mark.parametrize("scale", [1.0, 1e30])
def test_every_bound_keeps_the_warped_law_and_the_logprobs_finite(edge, temperature, scale):
    """Processors, warp and the reported law on logits as large as the docstring's bound allows (|x| = 1e30),
    every token already seen (the penalties bite everywhere), 64 generated tokens counted."""
    params = _edge_params(edge, temperature)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, V, generator=gen) * scale).float()  # [P, V]
    procs = build_processors(params, list(range(V)), V)
    for proc in procs:
        proc.commit(list(range(V)) * 2)
    processed = apply_all(procs, logits, [(), (1,), (1, 2)])  # [P, V]
    probs = warp(processed, *(t.expand(3) if t.dim() else t for t in warp_tensors([params])))
    assert torch.isfinite(processed).all() and torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert torch.isfinite(law_logprobs(processed, params.temperature)).all()


@pytest.fixture(scope="module")
def srv():
    with serve(engine(k=3, slots=4)) as s:
        yield s


def _finite_logprobs(body: dict) -> bool:
    lp = body["choices"][0]["logprobs"]
    values = lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()]
    # (a finite value below the floor is a true one: T = 1e-5 makes the runners-up very unlikely)
    return bool(values) and all(math.isfinite(v) and v != REPORTED_FLOOR for v in values)


def test_the_server_answers_every_bound_with_finite_logprobs_and_every_value_past_it_with_a_400(srv):
    with srv.http() as c:
        for edge in EDGES:
            for temperature in TEMPERATURES:
                body = {
                    "prompt": "abc",
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "logprobs": 5,
                    "seed": 1,
                    "temperature": temperature,
                } | edge
                if "logit_bias" in edge:
                    body["logit_bias"] = {str(t): b for t, b in edge["logit_bias"].items()}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200 and _finite_logprobs(r.json()), (body, r.text)
        for field, values in OUTSIDE.items():
            for value in values:
                for temperature in (0.0, 1.0) if field != "temperature" else (None,):
                    body = {"prompt": "abc", "max_tokens": 4, "logprobs": 1, field: value}
                    body |= {"temperature": temperature} if temperature is not None else {}
                    r = c.post("/v1/completions", content=_dumps(body), headers={"content-type": "application/json"})
                    assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200  # still serving


def _dumps(body: dict) -> str:
    """JSON with NaN / Infinity literals (as a careless client sends them)."""
    import json

    return json.dumps(body, allow_nan=True)
