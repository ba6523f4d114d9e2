"""Trees on the llama.cpp backend (specdecode/models/llamacpp_tree.py) on tiny GGUF files written here:
a tree forward's logits against the torch runner's on the same weights and against chain forwards of
each node's path, rows split between calls, branches adopted by compact/truncate then continued (= a
fresh prefill of the path), a drafter's level-by-level growth, slot copies and snapshots on the
shared stream, sequence ids returned to the pool, the masks llama.cpp cannot express refused;
through the engine: greedy equality with target-only decoding (draft-model, n-gram and Medusa trees,
batched) and the chi-square two-token law of sampled trees with a negative control; the CLI and
bench with trees on llama.cpp."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.llamacpp
pytest.importorskip("llama_cpp", reason="the llama.cpp backend is not installed (scripts/install-llamacpp.sh)")

from gguf_util import tiny_llamacpp_pair, write_gguf_like  # noqa: E402
from specdecode.config import EngineSettings  # noqa: E402
from specdecode.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specdecode.drafters.ngram import NgramDrafter  # noqa: E402
from specdecode.engine import Engine  # noqa: E402
from specdecode.models.hf import HFRunner  # noqa: E402
from specdecode.models.llamacpp import BackendUnsupported, LlamaCppModel, LlamaCppRunner  # noqa: E402
from specdecode.models.llamacpp_tree import MAX_SEQ, NodeTable, TreeUnsupported, check_ids  # noqa: E402
from specdecode.sampling import SamplingParams  # noqa: E402
from specdecode.tree import tree_layout  # noqa: E402
from tiny import make_model, make_tokenizer, perturbed_copy  # noqa: E402

V = 32
TOL = 0.05  # logits: llama.cpp keeps K/V in float16, torch in float32 (as in test_llamacpp)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 3, 3, 3, 3], [20, 21, 22, 23, 20, 21, 22, 5, 6]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llamacpp_pair(tmp_path_factory.mktemp("gguf-trees"), V, seed=0)  # test_tree_engine's pair


# a tree of 7 nodes under the root: 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}; node i is query i + 1
PARENTS = [-1, -1, 0, 0, 1, 2, 3]
TOKENS = [5, 9, 7, 2, 8, 4, 6]


def _tree(runner, slots, roots, starts, tokens=TOKENS, parents=PARENTS, per_row=None):
    b = len(slots)
    rows = per_row or [tokens] * b
    lay = tree_layout(
        torch.tensor(roots),
        torch.tensor(rows),
        torch.tensor([parents] * b),
        torch.tensor([len(parents)] * b),
        torch.tensor(starts),
    )
    out = runner.forward(
        torch.tensor(slots), lay.input_ids, lay.positions, write_positions=lay.write_positions, tree_mask=lay.mask
    )
    return runner.logits(out.hidden), lay


def _fwd(runner, slots, ids, positions):
    return runner.logits(runner.forward(torch.tensor(slots), torch.tensor(ids), torch.tensor(positions)).hidden)


def _path(q: int) -> list[int]:
    """Query indices from the root to query ``q``."""
    out = [q]
    while out[-1] != 0:
        out.append(PARENTS[out[-1] - 1] + 1)
    return out[::-1]


def test_a_tree_forward_equals_the_torch_runner_and_chains_of_each_path(tiny):
    target, _, gguf, _ = tiny
    ll, hf = LlamaCppRunner(gguf, 2, 64, trees=True), HFRunner(target, 2, 64)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    for r in (ll, hf):
        r.prefill([0, 1], prompts)
    a, lay = _tree(ll, [0, 1], [6, 9], [5, 3])
    b, _ = _tree(hf, [0, 1], [6, 9], [5, 3])
    assert a.shape == b.shape == (2, 8, V) and (a - b).abs().max() < TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    ids = lay.input_ids[0].tolist()
    chain = LlamaCppRunner(gguf, 1, 64)  # each node's logits = a chain forward of its root-to-node path
    for q in range(8):
        path = _path(q)
        chain.prefill([0], [prompts[0]])
        ref = _fwd(chain, [0], [[ids[j] for j in path]], [list(range(5, 5 + len(path)))])[0, -1]
        assert (a[0, q] - ref).abs().max() < 1e-2, q


def test_tree_rows_beyond_one_call_are_split_between_rows(tiny):
    """Three rows of 100-node trees (a chain each: one path, one id) exceed llama.cpp's 256 outputs per
    call: the rows go in two calls, each row whole, and match the torch runner."""
    target, _, gguf, _ = tiny
    ll, hf = LlamaCppRunner(gguf, 3, 160, trees=True), HFRunner(target, 3, 160)
    for r in (ll, hf):
        r.prefill([0, 1, 2], [[1, 2], [3, 4, 5], [6]])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (3, 99), generator=gen).tolist()
    chain = list(range(-1, 98))
    a, _ = _tree(ll, [0, 1, 2], [7, 8, 9], [2, 3, 1], tokens=None, parents=chain, per_row=tokens)
    b, _ = _tree(hf, [0, 1, 2], [7, 8, 9], [2, 3, 1], tokens=None, parents=chain, per_row=tokens)
    assert a.shape == (3, 100, V) and (a - b).abs().max() < TOL


@pytest.mark.parametrize("accepted", [[0, 1, 4, 7], [0, 2, 5], [0, 1, 3, 6], [0, 1], [0]])
def test_an_adopted_branch_continues_like_a_fresh_prefill(tiny, accepted):
    """compact() of a branch (as the engine calls it), or truncate() when the branch is a prefix in
    node order (queries 0, 1, ... at write index = position), then a chain forward: the same logits
    as a fresh prefill of the prompt and the branch's tokens; every sequence id is back in the pool."""
    _, _, gguf, _ = tiny
    r = LlamaCppRunner(gguf, 2, 64, trees=True)
    prompt = [3, 1, 4, 1, 5]
    r.prefill([0], [prompt[:-1]])
    free = r._tree.free_ids()
    _, lay = _tree(r, [0], [prompt[-1]], [4])
    start, ids = 4, lay.input_ids[0].tolist()
    if accepted == list(range(len(accepted))):
        r.truncate(0, start + len(accepted))
    else:
        r.compact(0, [start + q for q in accepted[1:]], start + 1)
        r.truncate(0, start + len(accepted))
    assert r._tree.free_ids() == free and not r._tree.held(0)
    branch = [ids[q] for q in accepted]
    pos = start + len(accepted)
    cont = _fwd(r, [0], [[11, 12]], [[pos, pos + 1]])
    r.prefill([1], [prompt[:-1] + branch])
    fresh = _fwd(r, [1], [[11, 12]], [[pos, pos + 1]])
    # within llama.cpp's batch-shape noise (K/V from an 8-token tree forward vs a prefill; ~4e-3 seen),
    # far below what K/V of another branch would change (order 1)
    assert (cont - fresh).abs().max() < 2e-2


def test_a_rejected_tree_leaves_the_committed_cache_alone(tiny):
    _, _, gguf, _ = tiny
    r = LlamaCppRunner(gguf, 1, 64, trees=True)
    r.prefill([0], [[3, 1, 4, 1]])
    before = _fwd(r, [0], [[5]], [[4]])
    r.truncate(0, 4)
    for _ in range(40):  # many trees, all rejected at the root: no id leaks, no cell leaks
        _tree(r, [0], [5], [4])
        r.truncate(0, 5)
        r.truncate(0, 4)
    assert r._tree.free_ids() == MAX_SEQ - 1
    assert (_fwd(r, [0], [[5]], [[4]]) - before).abs().max() < 2e-2  # batch-shape noise only


def test_a_drafter_grows_a_tree_level_by_level(tiny):
    """As the draft model's dynamic tree feeds it: each level a forward of new nodes whose mask names
    their ancestors among the nodes already written. Every level's logits equal the torch runner's."""
    target, _, gguf, _ = tiny
    ll, hf = LlamaCppRunner(gguf, 1, 64, trees=True), HFRunner(target, 1, 64)
    prompt = [7, 3, 9, 1, 4]
    for r in (ll, hf):
        r.prefill([0], [prompt])
    start = len(prompt)
    levels = [  # (node write offsets, tokens, depth, ancestors-or-self offsets per node)
        ([0, 1], [5, 6], 1, [[0], [1]]),
        ([2, 3, 4], [7, 8, 9], 2, [[0, 2], [0, 3], [1, 4]]),
        ([5, 5], [2, 2], 3, [[0, 2, 5], [0, 2, 5]]),  # padding repeats the last node: same K/V, same place
    ]
    for writes, toks, depth, seen in levels:
        mask = torch.zeros(1, len(writes), 6, dtype=torch.bool)
        for e, offs in enumerate(seen):
            mask[0, e, offs] = True
        args = (torch.tensor([0]), torch.tensor([toks]), torch.tensor([[start - 1 + depth] * len(writes)]))
        kw = dict(
            write_positions=torch.tensor([[start + w for w in writes]]),
            tree_mask=mask,
            tree_start=torch.tensor([start]),
        )
        a = ll.logits(ll.forward(*args, **kw).hidden)
        b = hf.logits(hf.forward(*args, **kw).hidden)
        assert (a - b).abs().max() < TOL and torch.equal(a.argmax(-1), b.argmax(-1))
    ll.compact(0, [start + 0, start + 2, start + 5], start)  # the drafter adopts the branch 5, 7, 2
    cont = _fwd(ll, [0], [[11]], [[start + 3]])
    fresh = LlamaCppRunner(gguf, 1, 64)
    fresh.prefill([0], [prompt + [5, 7, 2]])
    assert (cont - _fwd(fresh, [0], [[11]], [[start + 3]])).abs().max() < 2e-2  # batch-shape noise only


def test_slot_copies_and_snapshots_on_the_shared_stream(tiny):
    """A trees runner keeps one KV stream: copy_slot shares cells, export/import re-frame a snapshot;
    snapshots move between a chains runner (a stream per slot) and a trees runner both ways."""
    _, _, gguf, _ = tiny
    r, chains = LlamaCppRunner(gguf, 3, 64, trees=True), LlamaCppRunner(gguf, 2, 64)
    r.prefill([0], [[1, 2, 3, 4, 5, 6]])
    r.copy_slot(0, 2, 4)  # slot 2 holds positions 0..3 of slot 0 (shared cells)
    _fwd(r, [0], [[7]], [[6]])  # slot 0 goes on; slot 2 is unaffected
    state = r.export_kv(0, 5)
    r.import_kv(1, state)  # slot 1 holds positions 0..4
    chains.import_kv(1, state)
    chains.prefill([0], [[1, 2, 3, 4]])
    ref = _fwd(chains, [0], [[5, 6]], [[4, 5]])
    assert (_fwd(r, [2], [[5, 6]], [[4, 5]]) - ref).abs().max() < 1e-3
    assert (_fwd(r, [1], [[6]], [[5]])[0, 0] - ref[0, 1]).abs().max() < 1e-3
    assert (_fwd(chains, [1], [[6]], [[5]])[0, 0] - ref[0, 1]).abs().max() < 1e-3
    r.import_kv(2, chains.export_kv(0, 4))  # and back: a chains snapshot into the shared stream
    assert (_fwd(r, [2], [[5, 6]], [[4, 5]]) - ref).abs().max() < 1e-3


def test_masks_llama_cpp_cannot_express_are_refused(tiny):
    _, _, gguf, _ = tiny
    r = LlamaCppRunner(gguf, 1, 64, trees=True)
    r.prefill([0], [[1, 2, 3]])
    ids, pos = torch.tensor([[4, 5, 6]]), torch.tensor([[3, 4, 4]])
    writes = torch.tensor([[3, 4, 5]])
    sibling = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool)  # a node seeing its sibling
    with pytest.raises(TreeUnsupported, match="one node per position"):
        r.forward(torch.tensor([0]), ids, pos, write_positions=writes, tree_mask=sibling)
    # a node that does not see committed position 2: llama.cpp cannot hide a sequence's own cells
    with pytest.raises(TreeUnsupported, match="one node per position"):
        r.forward(
            torch.tensor([0]),
            torch.tensor([[4]]),
            torch.tensor([[3]]),
            write_positions=torch.tensor([[3]]),
            tree_mask=torch.tensor([[[1, 0, 1]]], dtype=torch.bool),
            tree_start=torch.tensor([1]),
        )
    assert not r._tree.held(0) and r._tree.free_ids() == MAX_SEQ - 1  # nothing was planned or taken
    ref = LlamaCppRunner(gguf, 1, 64)
    ref.prefill([0], [[1, 2, 3]])
    assert (_fwd(r, [0], [[4]], [[3]]) - _fwd(ref, [0], [[4]], [[3]])).abs().max() < 1e-3  # the slot is whole
    chains = LlamaCppRunner(gguf, 1, 64)
    chains.prefill([0], [[1, 2, 3]])
    with pytest.raises(BackendUnsupported, match="made for chains"):
        chains.forward(
            torch.tensor([0]), ids, pos, write_positions=writes, tree_mask=torch.ones(1, 3, 3, dtype=torch.bool)
        )


def test_the_node_table_counts_ids_per_leaf_and_refuses_too_many():
    table = NodeTable(num_slots=250)  # 6 ids left for tree paths
    # a chain of 4 nodes is one path: one id
    plan = table.plan(0, 10, [10, 11, 12, 13], [1, 2, 3, 4], [10, 11, 12, 13], [set(), {10}, {10, 11}, {10, 11, 12}])
    assert len({ids[0] for _, _, ids in plan.tokens}) == 1 and table.free_ids() == 5
    assert table.release(0) and table.free_ids() == 6
    star = [20 + i for i in range(8)]  # a root with 7 children: 7 leaves, more ids than are free
    with pytest.raises(TreeUnsupported, match="smaller batch"):
        table.plan(1, 20, star, list(range(8)), [20] + [21] * 7, [set()] + [{20}] * 7)
    assert table.free_ids() == 6 and not table.held(1)
    with pytest.raises(TreeUnsupported, match="at most 255 slots"):
        NodeTable(num_slots=256)
    check_ids(8, 16, "a verify")  # 8 slots + 8 x 16 leaves fit in 256 ids; 16 x 16 may not: refused up front
    with pytest.raises(TreeUnsupported, match="--max-batch-size"):
        check_ids(16, 16, "a verify")


# -- through the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k,topk,nodes", [(3, 2, 6), (4, 3, 12)])
def test_greedy_draft_model_trees_equal_llamacpp_target_only(tiny, k, topk, nodes):
    _, _, gt, gd = tiny
    tok = make_tokenizer(V)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gt), tok, None, 0, EngineSettings(max_batch_size=1, max_context=64)).generate(
        PROMPTS, sp
    )
    drafter = DraftModelDrafter(LlamaCppRunner(gd, trees=True), tree_topk=topk, tree_nodes=nodes)
    engine = Engine(
        LlamaCppRunner(gt, trees=True),
        tok,
        drafter,
        k,
        EngineSettings(max_batch_size=3, max_context=64, max_tree_nodes=nodes),
    )
    outs = engine.generate(PROMPTS, sp)  # 3 slots, 5 prompts: ragged
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.stats.accepted for o in outs) > 0 and sum(o.stats.nodes for o in outs) > sum(
        o.stats.drafted for o in outs
    )  # real trees were verified


def test_greedy_ngram_and_medusa_trees_equal_llamacpp_target_only(tiny):
    from specdecode.drafters.medusa import MedusaDrafter
    from test_medusa import tiny_heads

    target, _, gt, _ = tiny
    tok = make_tokenizer(V)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gt), tok, None, 0, EngineSettings(max_batch_size=1, max_context=64)).generate(
        PROMPTS, sp
    )
    heads = tiny_heads(target, noise=0.0, draft_vocab=V)
    for drafter in (NgramDrafter(tree_topk=2, tree_nodes=8), MedusaDrafter(heads, tree_topk=2, tree_nodes=6)):
        engine = Engine(
            LlamaCppRunner(gt, trees=True),
            tok,
            drafter,
            3,
            EngineSettings(max_batch_size=2, max_context=64, max_tree_nodes=drafter.max_tree_nodes),
        )
        outs = engine.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], drafter.name
        assert sum(o.stats.accepted for o in outs) > 0, drafter.name


VS = 12


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "negative-control"])
def test_sampled_trees_on_llamacpp_follow_the_target_law(tmp_path, wrong):
    """Chi-square GOF (bound ALPHA = 1e-4) of the first two tokens of 4000 seeded samples, draft-model
    trees (siblings drawn without replacement, 3 per node, 6 nodes, depth 2) with target and draft on
    llama.cpp, against the law of the llama.cpp target alone. The negative control verifies siblings
    drawn without replacement with the i.i.d. rule, which must fail."""
    from specdecode.verify import Verifier, verify_tree
    from specdecode.verify.tree import IID
    from test_engine import ALPHA, chi_square_p, sample_pairs
    from test_llamacpp import _law

    def iid_rule(tokens, parents, num, draft_probs, target_probs, uniforms, rule):
        return verify_tree(tokens, parents, num, draft_probs, target_probs, uniforms, IID)

    target = make_model(VS, seed=5, scale=0.5)
    draft = perturbed_copy(target, noise=0.6, seed=3)
    gt = LlamaCppModel(write_gguf_like(target, tmp_path / "t.gguf"), threads=1)
    gd = LlamaCppModel(write_gguf_like(draft, tmp_path / "d.gguf"), threads=1)
    prompt, n, batch, sp = [1, 2, 3], 4000, 20, SamplingParams(1.0)
    engine = Engine(
        LlamaCppRunner(gt, trees=True),
        make_tokenizer(VS),
        DraftModelDrafter(LlamaCppRunner(gd, trees=True), tree_topk=3, tree_nodes=6),
        3,
        EngineSettings(max_batch_size=batch, max_context=8, max_tree_nodes=6),
        verifier=Verifier(tree=iid_rule) if wrong else None,
    )
    counts = sample_pairs(engine, prompt, sp, n, batch, max_new_tokens=3)  # the first step drafts depth 2
    p = chi_square_p(counts, _law(LlamaCppRunner(gt, 1, 16), prompt, sp), n)
    assert (p < ALPHA) if wrong else (p > ALPHA)


# -- commands -------------------------------------------------------------------------------------------


def test_generate_and_bench_run_trees_on_llamacpp(tiny, capsys, tmp_path, monkeypatch):
    import argparse

    from specdecode.bench import cli as bench_cli
    from specdecode.cli import main

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd = tiny
    base = [
        "generate",
        "--target",
        str(gt.path),
        "--prompt",
        "xyxyx",
        "--max-new-tokens",
        "12",
        "--json",
        "--threads",
        "1",
    ]
    assert main(base) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(gd.path), "--tree-topk", "2", "--tree-nodes", "6"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["backend"] == alone["backend"] == "llamacpp" and tree["token_ids"] == alone["token_ids"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("xyxyxy", "yxxy")))
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    out = tmp_path / "bench"
    args = parser.parse_args(
        [
            "--backend",
            "llamacpp",
            "--target",
            str(gt.path),
            "--draft",
            str(gd.path),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--draft-lengths",
            "3",
            "--tree-shapes",
            "2x6",
            "--baselines",
            "none",
            "--no-progress",
            "--warmup-tokens",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert bench_cli.main(args) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["config"] for r in records if r["type"] == "run"} == {"target", "spec-k3", "spec-k3-t2n6"}
    checks = [r for r in records if r["type"] == "check" and r["config"] == "spec-k3-t2n6"]
    assert len(checks) == 2 and all(c["match"] for c in checks)  # greedy: the target-only tokens
