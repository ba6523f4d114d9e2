"""The runner interface: tree-shaped forwards, KV compaction, target features for drafters, a second
runner driving the engine through the protocol alone, devices and the drafter registry."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.config import EngineSettings
from specdecode.drafters import DraftContext, build_drafter, parse_draft
from specdecode.drafters.base import DrafterBase, TargetFeatures
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.models.base import FINAL
from specdecode.models.device import dtype_name, resolve_device
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from specdecode.tree import chain_parents, path_writes, root_to_leaf_paths, tree_layout
from tiny import make_model, make_tokenizer, perturbed_copy
from specdecode.models.backends.toy import ToyRunner

V = 32
TOK = make_tokenizer(V)


# -- the pure tree layout -----------------------------------------------------------------------------


def test_chain_layout_is_the_causal_chain():
    lay = tree_layout(
        torch.tensor([7, 8]),
        torch.tensor([[1, 2, 3], [4, 5, 0]]),
        chain_parents(2, 3),
        torch.tensor([3, 2]),
        torch.tensor([10, 4]),
    )
    assert lay.input_ids.tolist() == [[7, 1, 2, 3], [8, 4, 5, 0]]
    assert lay.positions[0].tolist() == [10, 11, 12, 13] and lay.positions[1, :3].tolist() == [4, 5, 6]
    assert lay.write_positions[1].tolist() == [4, 5, 6, 7]
    assert torch.equal(lay.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert root_to_leaf_paths(lay, torch.tensor([3, 2])) == [[[0, 1, 2, 3]], [[0, 1, 2]]]


def test_tree_layout_depths_masks_and_paths():
    #        root
    #       /    \
    #     n0      n1
    #    /  \       \
    #  n2    n3      n4
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    lay = tree_layout(torch.tensor([9]), torch.tensor([[1, 2, 3, 4, 5]]), parents, torch.tensor([5]), torch.tensor([3]))
    assert lay.depth[0].tolist() == [0, 1, 1, 2, 2, 2]
    assert lay.positions[0].tolist() == [3, 4, 4, 5, 5, 5]
    assert lay.write_positions[0].tolist() == [3, 4, 5, 6, 7, 8]
    assert lay.mask[0, 5].tolist() == [True, False, True, False, False, True]  # n4 sees root, n1, itself
    paths = {tuple(p) for p in root_to_leaf_paths(lay, torch.tensor([5]))[0]}
    assert paths == {(0, 1, 3), (0, 1, 4), (0, 2, 5)}
    assert path_writes(3, [0, 2, 5]) == [5, 8]
    with pytest.raises(ValueError, match="earlier node"):
        tree_layout(
            torch.tensor([9]), torch.tensor([[1, 2]]), torch.tensor([[1, -1]]), torch.tensor([2]), torch.tensor([0])
        )


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


# -- tree forward == chain forward of each node's path -----------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tree_forward_logits_equal_chain_forward_of_each_path(arch):
    model = make_model(V, seed=2, arch=arch)
    runner = HFRunner(model, 8, 64)
    rng = random.Random(0)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]  # ragged
    sizes = [7, 3, 0]  # ragged trees, one empty
    bsz, k = len(prompts), max(sizes)
    runner.prefill(list(range(bsz)), [p[:-1] for p in prompts])
    tokens = torch.zeros(bsz, k, dtype=torch.long)
    parents = torch.full((bsz, k), -1, dtype=torch.long)
    for b, n in enumerate(sizes):
        tokens[b, :n] = torch.tensor([rng.randrange(V) for _ in range(n)], dtype=torch.long)
        parents[b, :n] = torch.tensor(random_tree(rng, n), dtype=torch.long)
    start = torch.tensor([len(p) - 1 for p in prompts])
    lay = tree_layout(torch.tensor([p[-1] for p in prompts]), tokens, parents, torch.tensor(sizes), start)
    out = runner.forward(
        torch.arange(bsz), lay.input_ids, lay.positions, write_positions=lay.write_positions, tree_mask=lay.mask
    )
    tree_logits = runner.logits(out.hidden)  # [B, 1+K, V]
    for b, n in enumerate(sizes):
        for node in range(n + 1):
            path = lay.mask[b, node].nonzero().flatten().tolist()  # root .. node
            chain = lay.input_ids[b, path].tolist()
            ref_slot = 4 + b
            ids = prompts[b][:-1] + chain
            ref = runner.logits(
                runner.forward(torch.tensor([ref_slot]), torch.tensor([ids]), torch.arange(len(ids))[None]).hidden
            )[0, -1]
            torch.testing.assert_close(tree_logits[b, node], ref, atol=1e-4, rtol=1e-4)


def test_compacted_branch_continues_exactly_like_a_chain_run():
    """After a tree forward, keep one root-to-leaf branch (compaction) and decode on: the tokens are
    those of a run that only ever saw that branch as a chain."""
    model = make_model(V, seed=3)
    runner = HFRunner(model, 2, 64)
    prompt = [3, 1, 4, 1, 5, 9]
    parents = torch.tensor([[-1, -1, 0, 1, 2, 2, 3]])
    tokens = torch.tensor([[2, 6, 5, 3, 5, 8, 9]])
    start = len(prompt) - 1
    lay = tree_layout(torch.tensor([prompt[-1]]), tokens, parents, torch.tensor([7]), torch.tensor([start]))
    runner.prefill([0], [prompt[:-1]])
    runner.forward(
        torch.tensor([0]), lay.input_ids, lay.positions, write_positions=lay.write_positions, tree_mask=lay.mask
    )
    path = [0, 1, 3, 5]  # root, n0, n2, n4
    runner.compact(0, path_writes(start, path), start + 1)
    branch = lay.input_ids[0, path].tolist()

    def decode(slot: int, ids: list[int], cached: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            pos = torch.tensor([[cached]])
            tok = int(
                runner.logits(runner.forward(torch.tensor([slot]), torch.tensor([[ids[-1]]]), pos).hidden)[
                    0, 0
                ].argmax()
            )
            ids, cached = ids + [tok], cached + 1
            out.append(tok)
        return out

    context = prompt[:-1] + branch  # the last branch token is the new pending token
    kept = decode(0, context, len(context) - 1, 12)
    runner.prefill([1], [context[:-1]])
    assert kept == decode(1, context, len(context) - 1, 12)


# -- features reach the drafter ------------------------------------------------------------------------


class RecordingDrafter(DrafterBase):
    """n-gram proposals (so steps accept some, reject some), recording the features it is handed."""

    name = "recording"
    feature_layers = (FINAL, 1)

    def __init__(self) -> None:
        self.inner = NgramDrafter(max_ngram=2)
        self.seen: dict[int, dict[int, torch.Tensor]] = {}  # slot -> position -> {layer: [H]}
        self.tokens: dict[int, dict[int, int]] = {}

    def start(self, slots, prompts):
        for s in slots:
            self.seen[s], self.tokens[s] = {}, {}

    def observe(self, slots, features: list[TargetFeatures]):
        for s, f in zip(slots, features):
            for i, tok in enumerate(f.token_ids):
                self.tokens[s][f.start + i] = tok
                self.seen[s][f.start + i] = {layer: h[i].clone() for layer, h in f.hidden.items()}

    def propose(self, seqs, num_tokens):
        return self.inner.propose(seqs, num_tokens)


def test_drafter_receives_the_targets_hidden_states_of_every_cached_token():
    model = make_model(V, seed=4, layers=3)
    drafter = RecordingDrafter()
    engine = Engine(HFRunner(model), TOK, drafter, 3, EngineSettings(max_batch_size=2, max_context=64))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]]
    seqs = engine.add_batch([(p, SamplingParams(max_new_tokens=20, ignore_eos=True), None) for p in prompts])
    for _ in range(4):  # a few steps, all sequences still running
        engine.step()
    assert all(not s.finished for s in seqs)
    for seq in seqs:
        cached = seq.token_ids[:-1]
        seen = drafter.seen[seq.slot]
        assert sorted(seen) == list(range(len(cached)))
        assert [drafter.tokens[seq.slot][i] for i in range(len(cached))] == cached
        with torch.inference_mode():
            ref = model.model(torch.tensor([cached], device=model.device), output_hidden_states=True)
        final = torch.stack([seen[i][FINAL] for i in range(len(cached))])
        layer1 = torch.stack([seen[i][1] for i in range(len(cached))])
        torch.testing.assert_close(final, ref.last_hidden_state[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer1, ref.hidden_states[1][0], atol=1e-4, rtol=1e-4)
    assert sum(s.stats.accepted for s in seqs) > 0 and sum(s.stats.drafted - s.stats.accepted for s in seqs) > 0


def test_a_drafter_without_feature_layers_is_never_observed():
    class Strict(NgramDrafter):
        def observe(self, slots, features):
            raise AssertionError("observe called")

    model = make_model(V, seed=4)
    engine = Engine(HFRunner(model), TOK, Strict(), 3, EngineSettings(max_batch_size=1, max_context=32))
    assert engine.generate([[1, 2, 1, 2]], SamplingParams(max_new_tokens=6))[0].finish_reason


# -- a second runner drives the engine through the protocol alone --------------------------------------


def reference_greedy(runner: ToyRunner, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(runner.reference_logits(ids).argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_toy_runner_drives_the_engine(drafter_kind):
    target = ToyRunner(V, seed=0)
    drafter = DraftModelDrafter(ToyRunner(V, seed=1)) if drafter_kind == "model" else NgramDrafter()
    engine = Engine(target, TOK, drafter, 4, EngineSettings(max_batch_size=3, max_context=64))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 4, 5], [9], [10, 11, 10, 11]]
    params = SamplingParams(max_new_tokens=15, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for p, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, p, 15)
    assert sum(o.stats.drafted for o in outs) > 0


def test_step_events_carry_drafted_and_accepted_counts():
    target = ToyRunner(V, seed=0)
    engine = Engine(
        target, TOK, DraftModelDrafter(ToyRunner(V, seed=1)), 3, EngineSettings(max_batch_size=2, max_context=64)
    )
    totals: dict[str, list[int]] = {}
    for ev in engine.stream([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, seed=3, max_new_tokens=12)):
        t = totals.setdefault(ev.seq.request_id, [0, 0])
        t[0] += ev.drafted
        t[1] += ev.accepted
        if ev.finished:
            assert t == [ev.seq.stats.drafted, ev.seq.stats.accepted]
    assert len(totals) == 2


def test_engine_sizes_runner_caches_from_the_policy():
    target, draft = ToyRunner(V, seed=0), ToyRunner(V, seed=1)
    Engine(target, TOK, DraftModelDrafter(draft), 6, EngineSettings(max_batch_size=3, max_context=40))
    assert (target.num_slots, target.max_len) == (3, 40 + 7) and (draft.num_slots, draft.max_len) == (3, 47)


# -- devices and dtypes --------------------------------------------------------------------------------


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dtype_name("auto", "cuda") == "bfloat16" and dtype_name("fp32") == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_name("int3")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")


def test_engine_tensors_follow_the_runner_device():
    model = make_model(V, seed=1)
    engine = Engine(
        HFRunner(model),
        TOK,
        DraftModelDrafter(HFRunner(perturbed_copy(model, 0.2))),
        3,
        EngineSettings(max_batch_size=2, max_context=32),
    )
    assert engine.device == next(model.parameters()).device


# -- the drafter registry ------------------------------------------------------------------------------


def test_draft_specs():
    assert parse_draft("ngram").kind == "ngram" and parse_draft("ngram:2-4").arg == "2-4"
    assert parse_draft("qwen2.5-coder-0.5b") == parse_draft("model:qwen2.5-coder-0.5b")
    assert parse_draft("Qwen/Qwen2.5-0.5B").loads_model
    with pytest.raises(ValueError, match="name the model"):
        parse_draft("model:")
    ctx = DraftContext(ToyRunner(V), config=None)
    ng = build_drafter("ngram:2-4", ctx)
    assert (ng.min_ngram, ng.max_ngram) == (2, 4)
    with pytest.raises(ValueError, match="ngram:MIN-MAX"):
        build_drafter("ngram:x", ctx)
    with pytest.raises(ValueError, match="needs a draft model"):
        build_drafter("some-model", ctx)


# -- ragged prefill ------------------------------------------------------------------------------------------------


def test_pack_rows_bounds_padding_and_keeps_every_row_once():
    from specdecode.models.hf import pack_rows

    assert pack_rows([64, 64, 64]) == [[0, 1, 2]]  # alike: one forward
    assert pack_rows([256, 30]) == [[0], [1]]  # padding 30 to 256 would compute 1.8x the tokens
    assert pack_rows([20, 100, 90, 18, 85]) == [[1, 2, 4], [0, 3]]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        groups = pack_rows(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= 1.25 * sum(lengths[i] for i in g) + 1e-9


def test_a_ragged_prefill_computes_no_long_padding_and_equals_rows_prefilled_alone():
    """Three prompts of 40, 3 and 37 tokens at different starts: the short one goes alone (83 tokens
    computed, not 120), and every row's features and next logits equal the row prefilled by itself."""
    model = make_model(V, seed=2, layers=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (40, 3, 37)]
    starts = [0, 0, 5]
    runner = HFRunner(model, num_slots=3, max_len=64)
    computed = []
    forward = runner.forward
    runner.forward = lambda slots, ids, *a, **k: computed.append(ids.numel()) or forward(slots, ids, *a, **k)
    if starts[2]:  # the third row continues a prompt whose first 5 tokens are cached
        head = torch.randint(1, V, (5,), generator=g).tolist()
        forward(torch.tensor([2]), torch.tensor([head]), torch.arange(5)[None])
    feats = runner.prefill([0, 1, 2], prompts, [FINAL], starts=starts)
    assert sum(computed) == 2 * 40 + 3  # {40, 37} padded to 40, then {3} alone (not 3 x 40)
    for slot in range(3):
        alone = HFRunner(model, num_slots=1, max_len=64)
        if starts[slot]:
            alone.forward(torch.tensor([0]), torch.tensor([head]), torch.arange(5)[None])
        ref = alone.prefill([0], [prompts[slot]], [FINAL], starts=[starts[slot]])
        torch.testing.assert_close(feats[slot][FINAL], ref[0][FINAL], atol=1e-5, rtol=1e-5)
        pos = torch.tensor([[starts[slot] + len(prompts[slot])]])
        nxt = torch.tensor([[7]])
        torch.testing.assert_close(
            runner.logits(forward(torch.tensor([slot]), nxt, pos).hidden),
            alone.logits(alone.forward(torch.tensor([0]), nxt, pos).hidden),
            atol=1e-5,
            rtol=1e-5,
        )
