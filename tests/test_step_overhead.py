"""The step's fast paths against their slow, obviously-correct references (issue 57: the engine's own share
of a speculative step): the greedy choice by numpy (:func:`specdecode.sampling.greedy_tokens`) against
``torch.argmax``, and the llama.cpp runner's one copy of each row's logits against llama.cpp's own buffer."""

from __future__ import annotations

import pytest
import torch

import specdecode.engine as engine_module
from specdecode.drafters.ngram import NgramDrafter
from specdecode.sampling import SamplingParams, greedy_tokens
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 9, 8, 7]]
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "logits",
    [
        torch.randn(3, 5, 1000),
        torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]]),  # ties: the first index
        torch.tensor([[1.0, NAN, 5.0, NAN], [-INF, -INF, -INF, -INF], [2.0, INF, INF, 1.0]]),
        torch.randn(7, 4, 50).transpose(0, 1),  # not contiguous
        torch.randn(2, 40, dtype=torch.bfloat16),  # not float32: torch's own argmax
        torch.randn(4, 0, 16),  # no rows
    ],
    ids=["random", "ties", "nan-inf", "strided", "bf16", "empty"],
)
def test_greedy_tokens_equal_torch_argmax(logits):
    fast = greedy_tokens(logits)
    assert fast.dtype == torch.long
    assert torch.equal(fast, logits.argmax(-1))


@pytest.mark.parametrize("backend", ["torch", pytest.param("llamacpp", marks=pytest.mark.llamacpp)])
@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_greedy_steps_with_the_fast_choice_equal_the_reference(backend, drafter, monkeypatch):
    """Speculative greedy decoding emits the same tokens, step for step, with the numpy choice as with
    torch's argmax, on the torch and the llama.cpp runner, and it did draft."""
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
    target = make_model(V, seed=3)
    draft = perturbed_copy(target, noise=0.1)

    def engine():
        if drafter == "ngram":
            return make_engine(target, TOK, drafter=NgramDrafter(), k=4, num_slots=3, backend=backend)
        return make_engine(target, TOK, draft, k=4, num_slots=3, backend=backend)

    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    fast = engine().generate(PROMPTS, sp)
    monkeypatch.setattr(engine_module, "greedy_tokens", lambda logits: logits.argmax(-1))  # the reference
    ref = engine().generate(PROMPTS, sp)
    assert [o.token_ids for o in fast] == [o.token_ids for o in ref]
    assert [o.stats.accepted_at for o in fast] == [o.stats.accepted_at for o in ref]
    assert sum(o.stats.drafted for o in fast) > 0 and sum(o.stats.accepted for o in fast) > 0


@pytest.mark.llamacpp
def test_llamacpp_forward_rows_are_llamacpps_own_logits():
    """Each row's logits, copied once into the forward's output, are the rows of llama.cpp's buffer after
    the decode (one decode here: the rows fit), in order; a row's tail that is not run (positions that stop
    increasing) is zero."""
    pytest.importorskip("llama_cpp")
    import numpy as np

    from tiny import runner_for

    runner = runner_for(make_model(V, seed=4), "llamacpp")
    runner.ensure_capacity(3, 64)
    runner.prefill([0, 1, 2], [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    ids = torch.tensor([[3, 4, 5, 6], [6, 7, 8, 8], [9, 10, 11, 12]])
    pos = torch.tensor([[3, 4, 5, 6], [2, 3, 4, 4], [4, 5, 6, 7]])  # row 1: its last query is padding
    out = runner.logits(runner.forward(torch.arange(3), ids, pos).hidden)
    n = [4, 3, 4]
    buffer = np.ctypeslib.as_array(runner.ll.llama_get_logits(runner.ctx), shape=(sum(n), V))
    at = 0
    for b in range(3):
        assert torch.equal(out[b, : n[b]], torch.from_numpy(buffer[at : at + n[b]].copy()))
        at += n[b]
    assert torch.equal(out[1, 3:], torch.zeros(1, V))


@pytest.mark.llamacpp
def test_llamacpp_forward_of_a_long_row_equals_its_pieces(monkeypatch):
    """A row longer than one decode's outputs runs in pieces, each piece's logits placed at its offset: the
    same as forwarding the pieces one by one (the same decodes)."""
    pytest.importorskip("llama_cpp")
    import specdecode.models.llamacpp as llamacpp_module
    from tiny import runner_for

    monkeypatch.setattr(llamacpp_module, "OUTPUT_TOKENS", 5)
    model = make_model(V, seed=5)
    whole, pieces = runner_for(model, "llamacpp"), runner_for(model, "llamacpp")
    for r in (whole, pieces):
        r.ensure_capacity(1, 64)
        r.prefill([0], [[1, 2, 3]])
    toks = [(7 * i) % V for i in range(12)]
    slot = torch.tensor([0])
    a = whole.forward(slot, torch.tensor([toks]), torch.arange(3, 15)[None]).hidden[0]
    parts = [toks[lo : lo + 5] for lo in range(0, 12, 5)]
    b = torch.cat(
        [
            pieces.forward(slot, torch.tensor([p]), torch.arange(3 + 5 * i, 3 + 5 * i + len(p))[None]).hidden[0]
            for i, p in enumerate(parts)
        ]
    )
    assert torch.equal(a, b)
