"""The ik_llama.cpp backend (specdecode/models/ik_llamacpp.py: ik_llama.cpp's libllama under the llama.cpp
runner) on tiny GGUF files written here: its logits against the torch runner on the same weights, rollback,
batched rows, slot copies and snapshots on its one KV cache; through the engine, greedy equality with its own
target-only decoding for draft-model and n-gram chains and trees (speculation exercised), the two-token law of
sampled speculation with a negative control, the batch-invariant mode, `check` and `generate` through
``--backend ik_llamacpp``, a llama.cpp draft beside an ik target in one process, and ``--backend auto``'s
choice by a measured speed. Skipped where ik-llama-cpp-python is not installed (scripts/install-ik-llamacpp.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gguf_util import write_gguf_like
from tiny import make_model, make_tokenizer, perturbed_copy

from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.models.ik_llamacpp import IK, available
from specdecode.models.llamacpp import BackendUnsupported, LlamaCppModel, LlamaCppRunner
from specdecode.sampling import SamplingParams, params_tensors, warp

pytestmark = pytest.mark.ik_llamacpp
if not available():  # (without loading the library: a broken install fails the tests, not the collection)
    pytest.skip("the ik_llama.cpp backend is not installed (scripts/install-ik-llamacpp.sh)", allow_module_level=True)

V = 32
WIDE = 256  # hidden size whose heads (64 wide) run ik_llama.cpp's own flash attention (the fixture's 8 do not)
TOL = 0.05  # logits: ik_llama.cpp keeps K/V in float16, torch in float32 (as in test_llamacpp)
PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]]


def ik_model(path, threads: int = 1, repack: bool = True) -> LlamaCppModel:
    return LlamaCppModel(path, threads=threads, repack=repack, binding=IK)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and a draft that mostly agrees: transformers models, GGUF copies loaded by ik_llama.cpp."""
    d = tmp_path_factory.mktemp("ik-gguf")
    target = make_model(V, seed=1)
    draft = perturbed_copy(target, noise=0.15)
    gt, gd = write_gguf_like(target, d / "t.gguf"), write_gguf_like(draft, d / "d.gguf")
    return target, draft, ik_model(gt), ik_model(gd), d


def _fwd(runner, slots, ids, positions):
    out = runner.forward(torch.tensor(slots), torch.tensor(ids), torch.tensor(positions))
    return runner.logits(out.hidden)


def _settings(batch: int, context: int = 64, nodes: int = 0) -> EngineSettings:
    return EngineSettings(max_batch_size=batch, max_context=context, max_tree_nodes=nodes)


def test_logits_equal_the_torch_runner_on_the_same_weights(tiny):
    target, _, gguf, _, _ = tiny
    ik, hf = LlamaCppRunner(gguf, 3, 64), HFRunner(target, 3, 64)
    assert ik.backend == "ik_llamacpp" and ik.where.startswith("ik_llama.cpp ")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]  # ragged prefill
    for r in (ik, hf):
        r.prefill([0, 1, 2], prompts)
    ids, pos = [[3, 4, 5], [6, 7, 8], [9, 10, 11]], [[5, 6, 7], [2, 3, 4], [7, 8, 9]]
    a, b = _fwd(ik, [0, 1, 2], ids, pos), _fwd(hf, [0, 1, 2], ids, pos)
    assert a.shape == b.shape == (3, 3, V)
    assert (a - b).abs().max() < TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_rollback_then_continue_equals_a_fresh_prefill(tiny):
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 2, 64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    r.prefill([0], [prompt])
    _fwd(r, [0], [[5, 3, 5, 8]], [[8, 9, 10, 11]])  # a verify of 4 tokens ...
    r.truncate(0, 10)  # ... of which the first two are kept
    again = _fwd(r, [0], [[9, 7]], [[10, 11]])
    r.prefill([1], [prompt + [5, 3]])
    fresh = _fwd(r, [1], [[9, 7]], [[10, 11]])
    assert (again - fresh).abs().max() < 1e-3
    assert torch.equal(_fwd(r, [0], [[9, 7]], [[10, 11]]), again)  # the stale tail is dropped before a rewrite
    with pytest.raises(ValueError, match="cannot start at 20"):
        r.prefill([1], [[1, 2]], starts=[20])


def test_batched_rows_equal_each_row_alone(tiny):
    """One KV cache holds every slot: a row still attends to its own sequence's cells only."""
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 3, 64)
    r.prefill([0, 1, 2], [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11]])
    together = _fwd(r, [0, 1, 2], [[1, 2], [3, 4], [5, 6]], [[4, 5], [6, 7], [1, 2]])
    for b, (ids, pos) in enumerate([([1, 2], [4, 5]), ([3, 4], [6, 7]), ([5, 6], [1, 2])]):
        r.truncate(b, pos[0])
        assert (_fwd(r, [b], [ids], [pos])[0] - together[b]).abs().max() < 1e-3


def test_attention_sees_cells_above_an_empty_one(tiny):
    """One cache holds every slot, so a rollback leaves empty cells between other slots' cells. Here slot 1's
    cells 250..255 are freed below slot 2's 256..265: a decode of slot 2 must still attend to them (ik_llama.cpp
    0.1.5 sized the attention window by looking at one cell per 256 and stopped at cell 255:
    scripts/install-ik-llamacpp.sh patches that line), so its logits equal a fresh prefill's."""
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 3, 256)
    own = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    r.prefill([0], [[(7 * i) % V for i in range(250)]])  # cells 0..249
    r.prefill([1], [[1, 2, 3, 4, 5, 6]])  # cells 250..255
    r.prefill([2], [own])  # cells 256..265
    r.truncate(1, 0)
    after_hole = _fwd(r, [2], [[4]], [[10]])
    fresh = LlamaCppRunner(gguf, 1, 64)
    fresh.prefill([0], [own])
    # (float16 K/V attended over another window: ~3e-3 apart; without its own cells the row is another function)
    assert (after_hole - _fwd(fresh, [0], [[4]], [[10]])).abs().max() < 1e-2


def _several_slots(runner) -> torch.Tensor:
    """Four slots prefilled in one decode, then nine tokens verified in each of three slots in one decode:
    blocks of query rows that belong to several sequences. Their logits [3, 9, V]."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (5, 140, 9, 3)]
    runner.prefill([0, 1, 2, 3], prompts)
    slots = [3, 1, 0]
    ids = torch.randint(0, V - 1, (3, 9), generator=g)
    pos = torch.tensor([[len(prompts[s]) + j for j in range(9)] for s in slots])
    return runner.logits(runner.forward(torch.tensor(slots), ids, pos).hidden)


def _ik_several_slots(gguf: str, out: str) -> None:
    """The child process's half of the test below."""
    torch.save(_several_slots(LlamaCppRunner(ik_model(gguf), 4, 160)), out)


def test_flash_attention_over_several_slots_in_one_decode(tmp_path):
    """ik_llama.cpp 0.1.5's flash attention ran a block of query rows over the key blocks up to the last one
    whose first cell the block's last row sees (one causal sequence assumed), so a batched prefill of several
    slots in its one KV cache skipped every key block and aborted the process (GGML_ASSERT(S > 0), `check` on
    Qwen2.5-Coder), and rows of another sequence lost keys (scripts/install-ik-llamacpp.sh patches the scan
    out). Heads 64 wide take that kernel; the decode runs in a child process, so an abort fails this test
    alone. Logits equal the torch runner's on the same weights."""
    target = make_model(V, seed=1, hidden=WIDE)
    path, out = write_gguf_like(target, tmp_path / "wide.gguf"), tmp_path / "logits.pt"
    code = f"from test_ik_llamacpp import _ik_several_slots; _ik_several_slots({str(path)!r}, {str(out)!r})"
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert child.returncode == 0, [line for line in child.stderr.splitlines() if 'GGML' in line] or child.stderr[-3000:]
    ref = _several_slots(HFRunner(target, 4, 160))
    got = torch.load(out)
    assert got.shape == ref.shape == (3, 9, V)
    assert (got - ref).abs().max() < TOL


def test_copy_slot_export_and_import(tiny):
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 3, 64)
    r.prefill([0], [[1, 2, 3, 4, 5, 6]])
    r.copy_slot(0, 2, 4)  # slot 2 holds positions 0..3 of slot 0
    state = r.export_kv(0, 5)
    _fwd(r, [0], [[7]], [[6]])  # exporting a prefix leaves the slot whole: it continues at position 6
    r.import_kv(1, state)  # slot 1 holds positions 0..4
    a = _fwd(r, [2], [[5, 6]], [[4, 5]])
    b = _fwd(r, [1], [[6]], [[5]])
    r.prefill([0], [[1, 2, 3, 4]])
    ref = _fwd(r, [0], [[5, 6]], [[4, 5]])
    assert (a - ref).abs().max() < 1e-3 and (b[0, 0] - ref[0, 1]).abs().max() < 1e-3
    with pytest.raises(ValueError, match="other weights"):
        r.import_kv(1, ("ik_llamacpp:another", *state[1:]))
    other = LlamaCppRunner(gguf, 5, 128)  # another context size (as `check` has)
    other.import_kv(3, state)
    assert (_fwd(other, [3], [[6]], [[5]]) - b).abs().max() < 1e-3


def test_model_facts_and_kv_bytes(tiny):
    target, _, gguf, _, _ = tiny
    cfg = target.config
    assert (gguf.vocab_size, gguf.hidden_size, gguf.num_layers) == (V, cfg.hidden_size, cfg.num_hidden_layers)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert (
        LlamaCppRunner(gguf, 3, 100).kv_bytes()
        == 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 3 * 256
    )


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_equals_ik_target_only(tiny, k):
    """Draft model (on ik_llama.cpp too) and n-gram drafts, alone and batched: the same tokens as target-only
    decoding on ik_llama.cpp, with drafts accepted."""
    _, _, gguf_t, gguf_d, _ = tiny
    tok = make_tokenizer(V)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf_t), tok, None, 0, _settings(1)).generate(PROMPTS, sp)
    for drafter in (DraftModelDrafter(LlamaCppRunner(gguf_d)), NgramDrafter()):
        outs = Engine(LlamaCppRunner(gguf_t), tok, drafter, k, _settings(3)).generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], type(drafter).__name__
        assert sum(o.stats.drafted for o in outs) > 0 and sum(o.stats.accepted for o in outs) > 0


@pytest.mark.parametrize("k,topk,nodes", [(3, 2, 6), (4, 3, 12)])
def test_greedy_trees_equal_ik_target_only(tiny, k, topk, nodes):
    """Draft-model and n-gram trees (sequence ids per path on ik_llama.cpp's one cache): target-only's tokens,
    and real trees were verified (more nodes than drafted chains)."""
    _, _, gguf_t, gguf_d, _ = tiny
    tok = make_tokenizer(V)
    prompts = PROMPTS + [[3, 3, 3, 3, 3], [20, 21, 22, 23, 20, 21, 22, 5, 6]]
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf_t), tok, None, 0, _settings(1)).generate(prompts, sp)
    for drafter in (
        DraftModelDrafter(LlamaCppRunner(gguf_d, trees=True), tree_topk=topk, tree_nodes=nodes),
        NgramDrafter(tree_topk=topk, tree_nodes=nodes),
    ):
        engine = Engine(LlamaCppRunner(gguf_t, trees=True), tok, drafter, k, _settings(3, nodes=nodes))
        outs = engine.generate(prompts, sp)  # 3 slots, 5 prompts: ragged
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], type(drafter).__name__
        assert sum(o.stats.accepted for o in outs) > 0
        assert sum(o.stats.nodes for o in outs) > sum(o.stats.drafted for o in outs) > 0


VS = 12


def _law(runner: LlamaCppRunner, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """P(t1, t2) from the ik target alone: one-row forwards, warped like the engine warps."""
    t, k, p = params_tensors([sp])
    runner.prefill([0], [prompt[:-1]])
    first = warp(_fwd(runner, [0], [[prompt[-1]]], [[len(prompt) - 1]])[0], t, k, p)[0]
    second = []
    for a in range(VS):
        runner.truncate(0, len(prompt))
        second.append(warp(_fwd(runner, [0], [[a]], [[len(prompt)]])[0], t, k, p)[0])
    return first[:, None] * torch.stack(second)


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "negative-control"])
def test_samples_follow_the_ik_target_law(tmp_path, wrong):
    """Chi-square GOF (bound ALPHA = 1e-4) of the first two tokens of 4000 seeded samples at T = 1, target and
    draft both on ik_llama.cpp, against the law computed from the ik target alone; drafts were proposed and
    some rejected. The negative control (sample the target instead of the residual at a rejection) must fail."""
    from test_engine import ALPHA, chi_square_p
    from test_verify import wrong_rule_no_residual as wrong_rule

    from specdecode.verify import Verifier

    target = make_model(VS, seed=5, scale=0.5)
    draft = perturbed_copy(target, noise=0.6, seed=3)
    gt = ik_model(write_gguf_like(target, tmp_path / "t.gguf"))
    gd = ik_model(write_gguf_like(draft, tmp_path / "d.gguf"))
    prompt, n, batch, sp = [1, 2, 3], 4000, 250, SamplingParams(1.0)
    engine = Engine(
        LlamaCppRunner(gt),
        make_tokenizer(VS),
        DraftModelDrafter(LlamaCppRunner(gd)),
        3,
        EngineSettings(max_batch_size=batch, max_context=8),
        verifier=Verifier(speculative=wrong_rule) if wrong else None,
    )
    counts = torch.zeros(VS, VS)
    drafted = accepted = 0
    for start in range(0, n, batch):
        params = [SamplingParams(1.0, seed=start + i, max_new_tokens=2, ignore_eos=True) for i in range(batch)]
        for out in engine.generate([prompt] * batch, params):
            counts[out.token_ids[0], out.token_ids[1]] += 1
            drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert drafted > accepted > 0  # speculation ran, with rejections (where the residual matters)
    p = chi_square_p(counts, _law(LlamaCppRunner(gt, 1, 16), prompt, sp), n)
    assert (p < ALPHA) if wrong else (p > ALPHA)


def test_batch_invariant_rows_equal_one_token_decodes_bit_for_bit(tiny):
    """Invariant mode over weights loaded without repack (what --batch-invariant on loads): a row's logits
    are the same bits whatever shares its forward, and no llama_decode is wider than the probed width; a
    repacked model is refused for it."""
    model = ik_model(tiny[4] / "t.gguf", threads=2, repack=False)
    r = LlamaCppRunner(model, 3, 64, invariant=True)
    assert 1 <= r.decode_width <= 8 and "batch-invariant" in r.where
    widths = []
    submit = r._submit
    r._submit = lambda tokens, *a: (widths.append(len(tokens)), submit(tokens, *a))[1]
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]
    r.prefill([0], [seq[:4]])
    one = torch.cat([_fwd(r, [0], [[t]], [[4 + j]])[0] for j, t in enumerate(seq[4:])])
    r.truncate(0, 0)
    r.prefill([0, 1], [seq[:4], [7, 7, 7]])
    rest = list(range(4, len(seq)))
    together = _fwd(r, [0, 1], [seq[4:], [6] * len(rest)], [rest, [p - 1 for p in rest]])
    assert torch.equal(together[0], one)
    assert max(widths) <= r.decode_width and widths.count(1) >= len(seq) - 4
    with pytest.raises(BackendUnsupported, match="without CPU repack"):
        LlamaCppRunner(tiny[2], 1, 64, invariant=True)


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from specdecode.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _with_and_without_draft(base: list[str], draft, capsys) -> tuple[dict, dict]:
    """``generate --json`` with ``--draft draft`` and without it: both must succeed; their JSON objects."""
    runs = []
    for args in ([*base, "--draft", str(draft)], base):
        code, out, err = _cli(args, capsys)
        assert code == 0, err
        runs.append(json.loads(out))
    return runs[0], runs[1]


def test_generate_runs_on_ik_and_equals_its_target_only(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, _ = tiny
    base = ["generate", "--backend", "ik_llamacpp", "--target", str(gt.path), "--prompt", "xyxyx"]
    base += ["--max-new-tokens", "12", "--json", "--threads", "1"]
    spec, plain = _with_and_without_draft(base, gd.path, capsys)
    assert spec["stats"]["drafted"] > 0
    assert spec["backend"] == plain["backend"] == "ik_llamacpp" and spec["token_ids"] == plain["token_ids"]


def test_generate_batch_invariant_on_ik(tiny, capsys, monkeypatch, tmp_path):
    """--batch-invariant on through the command: the target loads without repack, its runner says invariant,
    and seeded coupled sampling with the draft equals coupled target-only token for token."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, _ = tiny
    base = ["generate", "--backend", "ik_llamacpp", "--target", str(gt.path), "--prompt", "xyxyx", "--json"]
    base += ["--max-new-tokens", "16", "--threads", "2", "--batch-invariant", "on", "--sampler", "coupled"]
    base += ["--temperature", "0.9", "--seed", "3"]
    spec, plain = _with_and_without_draft(base, gd.path, capsys)
    assert "batch-invariant" in spec["where"]["target"] and spec["stats"]["drafted"] > 0
    assert spec["token_ids"] == plain["token_ids"]


def test_check_passes_on_ik(tiny, capsys, tmp_path, monkeypatch):
    """`specdecode check` end to end on the ik pair (small settings): PASS, with drafts proposed."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, _ = tiny
    code, out, err = _cli(
        [
            "check",
            "--backend",
            "ik_llamacpp",
            "--target",
            str(gt.path),
            "--draft",
            str(gd.path),
            "--num-prompts",
            "2",
            "--law-samples",
            "300",
            "--no-progress",
            "--json",
            str(tmp_path / "check.json"),
        ],
        capsys,
    )
    report = json.loads((tmp_path / "check.json").read_text())
    assert code == 0, out + err
    assert report["meta"]["backend"] == "ik_llamacpp"
    assert sum(_values(report, "drafted")) > 0 and sum(_values(report, "accepted")) > 0


def _values(tree, key: str) -> list:
    """Every number stored under ``key`` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        own = [tree[key]] if isinstance(tree.get(key), int) else []
        return own + [x for v in tree.values() for x in _values(v, key)]
    if isinstance(tree, list):
        return [x for v in tree for x in _values(v, key)]
    return []


def test_a_llamacpp_draft_beside_an_ik_target(tiny):
    """Both libraries in one process (different sonames, loaded locally): a draft on llama.cpp, the target on
    ik_llama.cpp, greedy output equal to ik target-only."""
    pytest.importorskip("llama_cpp", reason="the llama.cpp backend is not installed (scripts/install-llamacpp.sh)")
    _, _, gguf_t, _, d = tiny
    tok = make_tokenizer(V)
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf_t), tok, None, 0, _settings(1)).generate(PROMPTS, sp)
    mainline = LlamaCppModel(d / "d.gguf", threads=1)
    outs = Engine(LlamaCppRunner(gguf_t), tok, DraftModelDrafter(LlamaCppRunner(mainline)), 3, _settings(3)).generate(
        PROMPTS, sp
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.stats.accepted for o in outs) > 0


def test_auto_takes_ik_only_where_a_profile_measured_it_faster(tiny):
    from specdecode.models import backends

    request = backends.Request(str(tiny[2].path))
    fast = {"ik_llamacpp": 30.0, "llamacpp": 20.0}
    choice = backends.choose("auto", request, lambda backend, target: fast.get(backend))
    assert choice.name == "ik_llamacpp" and "30.0 vs 20.0 tok/s" in choice.line() and "\n" not in choice.line()
    for measured in (None, lambda b, t: None, lambda b, t: {"ik_llamacpp": 19.0, "llamacpp": 20.0}[b]):
        assert backends.choose("auto", request, measured).name != "ik_llamacpp"
    assert backends.choose("ik_llamacpp", request).name == "ik_llamacpp"  # asked for: no profile needed
