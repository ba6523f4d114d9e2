"""The llama.cpp backend (specdecode/models/llamacpp.py) on tiny GGUF files written here: the runner
against the torch runner on the same weights, rollback, batching and slot operations, greedy equality
and the two-token law through the engine (with a negative control), the CLI's backend selection, and
the server and engine test modules rerun with every engine on llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
from specdecode.sampling import SamplingParams, params_tensors, warp  # noqa: E402
from tiny import make_model, make_tokenizer, perturbed_copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V = 32
TOL = 0.05  # logits: llama.cpp keeps K/V in float16, torch in float32 (observed max difference ~0.006)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and a draft that mostly agrees, as transformers models and as GGUF copies."""
    d = tmp_path_factory.mktemp("gguf")
    return (*tiny_llamacpp_pair(d, V, seed=1), d)


def _fwd(runner, slots, ids, positions):
    out = runner.forward(torch.tensor(slots), torch.tensor(ids), torch.tensor(positions))
    return runner.logits(out.hidden)


def test_logits_equal_the_torch_runner_on_the_same_weights(tiny):
    target, _, gguf, _, _ = tiny
    ll, hf = LlamaCppRunner(gguf, 3, 64), HFRunner(target, 3, 64)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]  # ragged prefill
    for r in (ll, hf):
        r.prefill([0, 1, 2], prompts)
    ids = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    pos = [[5, 6, 7], [2, 3, 4], [7, 8, 9]]
    a, b = _fwd(ll, [0, 1, 2], ids, pos), _fwd(hf, [0, 1, 2], ids, pos)
    assert a.shape == b.shape == (3, 3, V)
    assert (a - b).abs().max() < TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_resident_and_mapped_weights_give_the_same_logits(tiny, tmp_path):
    """--weights resident has llama.cpp read the file into its own buffers (load mode NONE), mapped maps it;
    the values are the same, so the logits are too."""
    import shutil

    path = tmp_path / "copy.gguf"  # a file no other model in this process maps
    shutil.copyfile(tiny[4] / "t.gguf", path)

    def maps_it() -> bool:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(str(path.resolve())) for line in f)

    resident = LlamaCppModel(path, threads=1, mmap=False)
    if os.path.exists("/proc/self/maps"):
        assert not maps_it(), "llama.cpp mapped the file with mmap=False"
    mapped = LlamaCppModel(path, threads=1)
    if os.path.exists("/proc/self/maps"):
        assert maps_it(), "llama.cpp did not map the file with mmap=True"
    assert (resident.mmap, mapped.mmap) == (False, True)
    out = []
    for model in (resident, mapped):
        r = LlamaCppRunner(model, 1, 64)
        r.prefill([0], [[1, 2, 3, 4, 5]])
        out.append(_fwd(r, [0], [[6, 7, 8]], [[5, 6, 7]]))
    assert torch.equal(out[0], out[1])


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
    # without the truncation the stale positions would be attended to (or refused): the runner drops
    # a slot's tail before writing over it, so feeding from position 10 again is the same computation
    repeat = _fwd(r, [0], [[9, 7]], [[10, 11]])
    assert torch.equal(repeat, again)


def test_prefill_in_chunks_equals_one_prefill(tiny):
    """A prompt prefilled in pieces (each starting where the slot ends, beside another row's piece)
    leaves the K/V of one whole prefill; a piece that does not continue the slot is refused."""
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 3, 64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    r.prefill([0], [prompt])
    r.prefill([1, 2], [prompt[:5], [7, 7, 7]])
    r.prefill([2, 1], [[1], prompt[5:11]], starts=[3, 5])
    r.prefill([1], [prompt[11:]], starts=[11])
    whole, chunked = _fwd(r, [0, 1], [[9, 3], [9, 3]], [[14, 15], [14, 15]]).unbind(0)
    assert (whole - chunked).abs().max() < 1e-2
    with pytest.raises(ValueError, match="cannot start at 20"):
        r.prefill([1], [[1, 2]], starts=[20])


def test_batched_rows_equal_each_row_alone(tiny):
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 3, 64)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11]]
    r.prefill([0, 1, 2], prompts)
    together = _fwd(r, [0, 1, 2], [[1, 2], [3, 4], [5, 6]], [[4, 5], [6, 7], [1, 2]])
    for b, (ids, pos) in enumerate([([1, 2], [4, 5]), ([3, 4], [6, 7]), ([5, 6], [1, 2])]):
        r.truncate(b, pos[0])
        alone = _fwd(r, [b], [ids], [pos])
        assert (alone[0] - together[b]).abs().max() < 1e-3


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
        r.import_kv(1, ("llamacpp:another", *state[1:]))
    other = LlamaCppRunner(gguf, 5, 128)  # another context size and stream count (as `check` has)
    other.import_kv(3, state)
    assert (_fwd(other, [3], [[6]], [[5]]) - b).abs().max() < 1e-3


def test_features_are_the_final_hidden_state(tiny):
    target, _, gguf, _, _ = tiny
    from specdecode.models.base import FINAL

    ll, hf = LlamaCppRunner(gguf, 1, 64), HFRunner(target, 1, 64)
    fl = ll.prefill([0], [[1, 2, 3, 4]], layers=(FINAL,))[0][FINAL]
    fh = hf.prefill([0], [[1, 2, 3, 4]], layers=(FINAL,))[0][FINAL]
    assert fl.shape == fh.shape == (4, 32) and (fl - fh).abs().max() < TOL
    out = ll.forward(torch.tensor([0]), torch.tensor([[5, 6]]), torch.tensor([[4, 5]]), layers=(FINAL,))
    assert out.features[FINAL].shape == (1, 2, 32)
    with pytest.raises(BackendUnsupported, match="final hidden state only"):
        ll.prefill([0], [[1, 2]], layers=(1,))


def test_kv_bytes_counts_the_kv_heads(tiny):
    target, _, gguf, _, _ = tiny
    cfg = target.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # K and V, float16, every layer, every slot's stream (rounded up to 256 positions)
    assert (
        LlamaCppRunner(gguf, 3, 100).kv_bytes()
        == 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 3 * 256
    )


def test_embeddings_are_refused_clearly(tiny):
    _, _, gguf, _, _ = tiny
    r = LlamaCppRunner(gguf, 1, 64)
    with pytest.raises(BackendUnsupported, match="embeddings"):
        r.embed(torch.tensor([1]))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_equals_llamacpp_target_only(tiny, k):
    """Draft model (on llama.cpp too) and n-gram drafts, alone and batched: the same tokens as
    target-only decoding on llama.cpp."""
    _, _, gguf_t, gguf_d, _ = tiny
    tok = make_tokenizer(V)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf_t), tok, None, 0, EngineSettings(max_batch_size=1, max_context=64)).generate(
        prompts, sp
    )
    for drafter in (DraftModelDrafter(LlamaCppRunner(gguf_d)), NgramDrafter()):
        eng = Engine(LlamaCppRunner(gguf_t), tok, drafter, k, EngineSettings(max_batch_size=3, max_context=64))
        outs = eng.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert sum(o.stats.accepted for o in outs) > 0


def test_a_llamacpp_draft_model_started_late_drafts_exactly(tiny):
    """Under the selector a draft model reads a request only once it drafts for it: here n-gram lookup
    drafts until 20 tokens were generated (more than a proposal reads in one forward), then the
    llama.cpp draft model starts, prefills prompt and backlog, and drafts. Greedy output is unchanged;
    and since the draft model here is the target itself, its proposals are the target's own next
    tokens only if it read prompt and backlog right (a wrong cache would propose other tokens)."""
    from specdecode.drafters.multi import MultiDrafter

    _, _, gguf_t, _, _ = tiny
    tok = make_tokenizer(V)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf_t), tok, None, 0, EngineSettings(max_batch_size=1, max_context=80)).generate(
        prompts, sp
    )
    full = {tuple(p): p + o.token_ids for p, o in zip(prompts, ref)}
    route = lambda s: "model" if len(s.token_ids) - len(s.prompt_ids) >= 20 else "ngram"  # noqa: E731
    model = DraftModelDrafter(LlamaCppRunner(gguf_t))
    hits, proposed = [], []
    propose = model.propose

    def recording(seqs, ks):
        out = propose(seqs, ks)
        for b, s in enumerate(seqs):
            proposed.append(len(s.token_ids) - len(s.prompt_ids))
            truth = full[tuple(s.prompt_ids)][len(s.token_ids) :]
            hits.extend(t == u for t, u in zip(out.tokens[b, : int(out.num_tokens[b])].tolist(), truth))
        return out

    model.propose = recording
    multi = MultiDrafter({"model": model, "ngram": NgramDrafter()}, route)
    outs = Engine(LlamaCppRunner(gguf_t), tok, multi, 3, EngineSettings(max_batch_size=3, max_context=80)).generate(
        prompts, sp
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert proposed and min(proposed) >= 20 and len(hits) >= 20
    assert sum(hits) >= 0.9 * len(hits), f"{sum(hits)} of {len(hits)} proposals were the target's tokens"


@pytest.mark.parametrize("pieces", [5, 0], ids=["read-in-pieces", "negative-control"])
def test_a_llamacpp_draft_model_reads_a_backlog_in_pieces(tiny, pieces):
    """The selector's late start beside other streams: the llama.cpp draft model (= the target) reads
    prompt + 30 generated tokens 5 at a time through the multi-drafter, two requests sharing each
    piece, then proposes: the target's own next tokens. Negative control: the same reads with each
    piece's tokens shifted by one position (what a wrong start would write) propose other tokens."""
    from types import SimpleNamespace

    from specdecode.drafters.multi import MultiDrafter

    _, _, gguf_t, _, _ = tiny
    tok = make_tokenizer(V)
    prompts = [[1, 2, 3, 1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2]]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf_t), tok, None, 0, EngineSettings(max_batch_size=1, max_context=80)).generate(
        prompts, sp
    )
    model = DraftModelDrafter(LlamaCppRunner(gguf_t))
    model.reserve(2, 80)
    multi = MultiDrafter({"model": model, "ngram": NgramDrafter()}, lambda s: "model")
    multi.start([0, 1], prompts)
    views = [
        SimpleNamespace(slot=i, token_ids=p + o.token_ids[:30], params=SamplingParams(), generator=torch.Generator())
        for i, (p, o) in enumerate(zip(prompts, ref))
    ]
    if not pieces:  # the control: the backlog written one position off
        model.runner.prefill([0, 1], [v.token_ids[:1] + v.token_ids[:-2] for v in views], starts=[0, 0])
        for v in views:
            model._cached[v.slot], model._floor[v.slot] = list(v.token_ids[:-1]), len(v.token_ids) - 1
            multi.parts._waiting["model"].pop(v.slot)
    read = []
    while pieces and (n := multi.parts.read(views, "model", pieces)) > 0:
        read.append(n)
    assert not pieces or (max(read) <= 5 and sum(read) == sum(len(v.token_ids) - 1 for v in views))
    out = multi.propose(views, [4, 4])
    hits = sum(int(t) == u for b, o in enumerate(ref) for t, u in zip(out.tokens[b], o.token_ids[30:34]))
    assert hits == 8 if pieces else hits < 8, hits  # (the control: 5 of 8 here)


def test_medusa_heads_draft_from_the_llamacpp_final_state(tiny):
    """Medusa reads the target's final hidden state, which llama.cpp gives as its embeddings output:
    the same heads draft and get accepted as they do over the torch runner (wrong features would not)."""
    from specdecode.drafters.medusa import MedusaDrafter
    from test_medusa import tiny_heads

    target, _, gguf, _, _ = tiny
    tok = make_tokenizer(V)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = Engine(LlamaCppRunner(gguf), tok, None, 0, EngineSettings(max_batch_size=3, max_context=64)).generate(
        prompts, sp
    )
    heads = tiny_heads(target, noise=0.0, draft_vocab=V)
    outs = Engine(
        LlamaCppRunner(gguf), tok, MedusaDrafter(heads), 3, EngineSettings(max_batch_size=3, max_context=64)
    ).generate(prompts, sp)
    on_torch = Engine(
        HFRunner(target), tok, MedusaDrafter(heads), 3, EngineSettings(max_batch_size=3, max_context=64)
    ).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref] == [o.token_ids for o in on_torch]
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert accepted > 0 and abs(accepted - sum(o.stats.accepted for o in on_torch)) <= 0.1 * drafted


# -- the law of sampled tokens ------------------------------------------------------------------------

VS = 12


def _law(runner: LlamaCppRunner, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """P(t1, t2) from the llama.cpp target alone: one-row forwards, warped like the engine warps."""
    t, k, p = params_tensors([sp])
    runner.prefill([0], [prompt[:-1]])
    first = warp(_fwd(runner, [0], [[prompt[-1]]], [[len(prompt) - 1]])[0], t, k, p)[0]
    second = []
    for a in range(VS):
        runner.truncate(0, len(prompt))
        second.append(warp(_fwd(runner, [0], [[a]], [[len(prompt)]])[0], t, k, p)[0])
    return first[:, None] * torch.stack(second)


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "negative-control"])
@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["T1", "T0.7-p0.9"])
def test_samples_follow_the_llamacpp_target_law(tmp_path, sp, wrong):
    """Chi-square GOF (bound ALPHA = 1e-4) of the first two tokens of 4000 seeded samples, target and
    draft both on llama.cpp, against the law computed from the llama.cpp target alone. The negative
    control (sample the target instead of the residual at a rejection) must fail."""
    from specdecode.verify import Verifier
    from test_verify import wrong_rule_no_residual as wrong_rule
    from test_engine import ALPHA, chi_square_p

    if wrong and sp.temperature != 1.0:
        pytest.skip("one negative control is enough")
    target = make_model(VS, seed=5, scale=0.5)
    draft = perturbed_copy(target, noise=0.6, seed=3)
    gt = LlamaCppModel(write_gguf_like(target, tmp_path / "t.gguf"), threads=1)
    gd = LlamaCppModel(write_gguf_like(draft, tmp_path / "d.gguf"), threads=1)
    prompt, n, batch = [1, 2, 3], 4000, 250
    engine = Engine(
        LlamaCppRunner(gt),
        make_tokenizer(VS),
        DraftModelDrafter(LlamaCppRunner(gd)),
        3,
        EngineSettings(max_batch_size=batch, max_context=8),
        verifier=Verifier(speculative=wrong_rule) if wrong else None,
    )
    counts = torch.zeros(VS, VS)
    for start in range(0, n, batch):
        params = [
            SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=start + i, max_new_tokens=2, ignore_eos=True)
            for i in range(batch)
        ]
        for out in engine.generate([prompt] * batch, params):
            counts[out.token_ids[0], out.token_ids[1]] += 1
    p = chi_square_p(counts, _law(LlamaCppRunner(gt, 1, 16), prompt, sp), n)
    assert (p < ALPHA) if wrong else (p > ALPHA)


# -- commands -------------------------------------------------------------------------------------------


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from specdecode.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_runs_on_llamacpp_and_says_so(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, _ = tiny
    code, out, err = _cli(
        [
            "generate",
            "--backend",
            "llamacpp",
            "--target",
            str(gt.path),
            "--draft",
            str(gd.path),
            "--prompt",
            "xyxyx",
            "--max-new-tokens",
            "12",
            "--json",
            "--threads",
            "1",
        ],
        capsys,
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["backend"] == "llamacpp"
    auto_code, auto_out, auto_err = _cli(
        [
            "generate",
            "--target",
            str(gt.path),
            "--draft",
            str(gd.path),
            "--prompt",
            "xyxyx",
            "--max-new-tokens",
            "12",
            "--json",
        ],
        capsys,
    )
    assert auto_code == 0, auto_err
    auto = json.loads(auto_out)  # auto: a .gguf target on llama.cpp, the same greedy tokens
    assert auto["backend"] == "llamacpp" and auto["token_ids"] == result["token_ids"]


@pytest.mark.parametrize(
    "extra, message", [(["--dtype", "bfloat16"], "--dtype"), (["--draft-quantization", "int8"], "--draft-quantization")]
)
def test_llamacpp_refuses_what_it_cannot_run_before_loading(tiny, capsys, extra, message):
    _, _, gt, gd, _ = tiny
    code, _, err = _cli(
        [
            "generate",
            "--backend",
            "llamacpp",
            "--target",
            str(gt.path),
            "--draft",
            str(gd.path),
            "--prompt",
            "xy",
            *extra,
        ],
        capsys,
    )
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_missing_install_is_one_line_with_the_fix(tiny, capsys, monkeypatch):
    from specdecode.models import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    _, _, gt, _, _ = tiny
    code, _, err = _cli(["generate", "--backend", "llamacpp", "--target", str(gt.path), "--prompt", "xy"], capsys)
    assert code == 2 and "scripts/install-llamacpp.sh" in err
    code, out, err = _cli(
        ["generate", "--target", str(gt.path), "--prompt", "xy", "--max-new-tokens", "2", "--json"], capsys
    )  # auto falls back to torch
    assert code == 0 and json.loads(out)["backend"] == "torch"


def test_a_non_gguf_target_is_refused_for_llamacpp(tiny, capsys, tmp_path):
    target, *_ = tiny
    target.save_pretrained(tmp_path / "m")
    make_tokenizer(V).save_pretrained(tmp_path / "m")
    code, _, err = _cli(
        ["generate", "--backend", "llamacpp", "--target", str(tmp_path / "m"), "--prompt", "xy"], capsys
    )
    assert code == 2 and ".gguf" in err


def test_check_passes_on_llamacpp(tiny, capsys, tmp_path, monkeypatch):
    """`specdecode check` end to end on the llama.cpp pair (small settings)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, _ = tiny
    code, out, err = _cli(
        [
            "check",
            "--backend",
            "llamacpp",
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
    assert report["meta"]["backend"] == "llamacpp"


@pytest.mark.slow
def test_server_and_engine_suites_pass_with_every_engine_on_llamacpp():
    """The server and engine test modules, rerun with $SPECDECODE_TEST_BACKEND=llamacpp: every engine
    they build (tests/tiny.py make_engine) runs its models on llama.cpp over GGUF copies."""
    modules = [
        "tests/test_server_e2e.py",
        "tests/test_server_faults.py",
        "tests/test_server_units.py",
        "tests/test_engine.py",
        "tests/test_first_token.py",
        "tests/test_chunked_prefill.py",
    ]
    env = os.environ | {"SPECDECODE_TEST_BACKEND": "llamacpp", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


# -- a .gguf draft kept quantized on llama.cpp beside a torch target (--draft-quantization gguf|q8_0|q4_0) ----


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "negative-control"])
def test_torch_target_with_a_llamacpp_draft_keeps_the_target_law(tmp_path, wrong):
    """Chi-square GOF (ALPHA = 1e-4) of the first two tokens of 4000 seeded samples at T = 0.8, the
    target on torch and the draft on llama.cpp, against the target's law by plain HF forwards; the
    negative control (sample the target instead of the residual at a rejection) must fail."""
    from specdecode.verify import Verifier
    from test_verify import wrong_rule_no_residual as wrong_rule
    from test_engine import ALPHA, chi_square_p, exact_two_token_law

    target = make_model(VS, seed=5, scale=0.5)
    draft = perturbed_copy(target, noise=0.6, seed=3)
    gd = LlamaCppModel(write_gguf_like(draft, tmp_path / "d.gguf"), threads=1)
    sp, prompt, n, batch = SamplingParams(0.8), [1, 2, 3], 4000, 250
    engine = Engine(
        HFRunner(target),
        make_tokenizer(VS),
        DraftModelDrafter(LlamaCppRunner(gd)),
        3,
        EngineSettings(max_batch_size=batch, max_context=8),
        verifier=Verifier(speculative=wrong_rule) if wrong else None,
    )
    counts = torch.zeros(VS, VS)
    for start in range(0, n, batch):
        params = [
            SamplingParams(sp.temperature, seed=start + i, max_new_tokens=2, ignore_eos=True) for i in range(batch)
        ]
        for out in engine.generate([prompt] * batch, params):
            counts[out.token_ids[0], out.token_ids[1]] += 1
    p = chi_square_p(counts, exact_two_token_law(target, prompt, sp), n)
    assert (p < ALPHA) if wrong else (p > ALPHA)


def test_requantized_drafts_are_cached_and_draft_exactly(tiny, tmp_path, monkeypatch):
    from specdecode.models import llamacpp

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target, _, _, gd, _ = tiny
    tok = make_tokenizer(V)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7]]
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ref = Engine(HFRunner(target), tok, None, 0, EngineSettings(max_batch_size=2, max_context=64)).generate(prompts, sp)
    for mode in ("q8_0", "q4_0"):
        path = llamacpp.requantize(gd.path, mode, threads=1)
        assert path.is_file() and path.parent.parent == tmp_path / "cache"
        real = llamacpp.lib().llama_model_quantize
        monkeypatch.setattr(llamacpp.lib(), "llama_model_quantize", lambda *a: pytest.fail("quantized twice"))
        assert llamacpp.requantize(gd.path, mode, threads=1) == path  # the cached file
        monkeypatch.setattr(llamacpp.lib(), "llama_model_quantize", real)
        drafter = DraftModelDrafter(LlamaCppRunner(LlamaCppModel(path, threads=1)))
        outs = Engine(HFRunner(target), tok, drafter, 3, EngineSettings(max_batch_size=2, max_context=64)).generate(
            prompts, sp
        )
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert sum(o.stats.accepted for o in outs) > 0
    with pytest.raises(ValueError, match="q8_0"):
        llamacpp.requantize(gd.path, "q2_k")


def test_cli_runs_a_gguf_draft_on_llamacpp_beside_a_torch_target(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, d = tiny
    base = [
        "generate",
        "--backend",
        "torch",
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
    code, out, err = _cli(base, capsys)
    assert code == 0, err
    alone = json.loads(out)["token_ids"]
    for extra in (["--draft", str(gd.path), "--draft-quantization", "gguf"], ["--draft", f"{gd.path}@q4_0"]):
        code, out, err = _cli(base + extra, capsys)
        assert code == 0, err
        result = json.loads(out)
        assert result["backend"] == "torch" and result["token_ids"] == alone
    tiny[1].save_pretrained(d / "hf")  # the draft as a transformers directory: not a .gguf file
    make_tokenizer(V).save_pretrained(d / "hf")
    capsys.readouterr()
    code, out, err = _cli(base + ["--draft", f"{gd.path}@q4_0", "--tree-topk", "2", "--tree-nodes", "6"], capsys)
    assert code == 0, err  # trees grown by the llama.cpp draft beside the torch target
    assert json.loads(out)["token_ids"] == alone
    code, _, err = _cli(base + ["--draft", str(d / "hf"), "--draft-quantization", "gguf"], capsys)
    assert code == 2 and "not a .gguf" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bench_compares_the_gguf_draft_on_llamacpp_with_the_torch_one(tiny, tmp_path, monkeypatch):
    import argparse

    from specdecode.bench import cli as bench_cli

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    _, _, gt, gd, _ = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("xyxyxy", "yxxy", "xxyyxx")))
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    out = tmp_path / "bench"
    args = parser.parse_args(
        [
            "--backend",
            "torch",
            "--target",
            str(gt.path),
            "--draft",
            str(gd.path),
            "--prompts",
            str(prompts),
            "--draft-lengths",
            "3",
            "--draft-quantization",
            "none,gguf,q4_0",
            "--max-new-tokens",
            "10",
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
    assert {r["config"] for r in records if r["type"] == "run"} == {"target", "spec-k3", "spec-k3@gguf", "spec-k3@q4_0"}
    checks = [r for r in records if r["type"] == "check" and "@" in r["config"]]
    assert len(checks) == 6 and all(c["match"] for c in checks)  # greedy: the target-only tokens


def test_hidden_states_of_the_model_width_go_through_the_files_output_layer(tiny):
    """What a heads checkpoint's fingerprint probe needs: score_hidden() of a final normed state equals the
    torch runner's logits on the same weights (logits() passes its forward's output through)."""
    from specdecode.models.medusa import model_fingerprint

    target, _, gguf, _, _ = tiny
    ll, hf = LlamaCppRunner(gguf), HFRunner(target)
    probe = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert (ll.score_hidden(probe) - hf.logits(probe)).abs().max() < 1e-4
    assert model_fingerprint(ll) == model_fingerprint(hf)
    with pytest.raises(BackendUnsupported, match="width"):
        ll.score_hidden(torch.zeros(2, target.config.hidden_size + 1))


@pytest.fixture(scope="module")
def invariant_target(tiny):
    """The tiny target loaded for --batch-invariant on (no CPU repack), on two threads (so one-token decodes
    and batches would take different thread counts without the mode)."""
    return LlamaCppModel(tiny[4] / "t.gguf", threads=2, repack=False)


def test_batch_invariant_rows_equal_one_token_decodes_bit_for_bit(invariant_target):
    """Invariant mode: a row's logits are the same bits whatever shares its forward (its own earlier tokens,
    other slots' rows, prefill chunking), and no llama_decode is wider than the probed width."""
    r = LlamaCppRunner(invariant_target, 3, 64, invariant=True)
    assert 1 <= r.decode_width <= 8 and "batch-invariant" in r.where
    widths = []
    submit = r._submit
    r._submit = lambda tokens, *a: (widths.append(len(tokens)), submit(tokens, *a))[1]
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]
    r.prefill([0], [seq[:4]])
    one = torch.cat([_fwd(r, [0], [[t]], [[4 + j]])[0] for j, t in enumerate(seq[4:])])  # one token at a time
    r.truncate(0, 0)
    r.prefill([0, 1], [seq[:4], [7, 7, 7]])
    together = _fwd(
        r, [0, 1], [seq[4:], [6] * len(seq[4:])], [list(range(4, len(seq))), list(range(3, 3 + len(seq[4:])))]
    )
    assert torch.equal(together[0], one)
    r.truncate(0, 0)
    r.prefill([0], [seq[:2]])
    r.prefill([0], [seq[2:4]], starts=[2])  # another chunking of the prompt
    assert torch.equal(_fwd(r, [0], [seq[4:]], [list(range(4, len(seq)))])[0], one)
    assert max(widths) <= r.decode_width and widths.count(1) >= len(seq) - 4


def test_batch_invariant_refuses_a_repacked_model_and_trees(tiny, invariant_target):
    with pytest.raises(BackendUnsupported, match="without CPU repack"):
        LlamaCppRunner(LlamaCppModel(tiny[4] / "t.gguf", threads=1), 1, 64, invariant=True)
    with pytest.raises(BackendUnsupported, match="chains only"):
        LlamaCppRunner(invariant_target, 1, 64, trees=True, invariant=True)


def test_coupled_speculation_on_an_invariant_target_equals_target_only(tiny, invariant_target):
    """--sampler coupled over the invariant runner: seeded outputs equal coupled target-only decoding token for
    token, for a draft model at k = 2, 4, 8 and n-gram lookup, alone and batched (speculation exercised)."""
    _, _, _, gguf_d, _ = tiny
    tok = make_tokenizer(V)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=30, ignore_eos=True, seed=40 + i, sampler="coupled")
        for i in range(len(prompts))
    ]

    def run(drafter, k, batch):
        eng = Engine(
            LlamaCppRunner(invariant_target, invariant=True),
            tok,
            drafter,
            k,
            EngineSettings(max_batch_size=batch, max_context=64),
        )
        outs = [
            o
            for lo in range(0, len(prompts), batch)
            for o in eng.generate(prompts[lo : lo + batch], params[lo : lo + batch])
        ]
        return [o.token_ids for o in outs], sum(o.stats.drafted for o in outs)

    ref, _ = run(None, 0, 1)
    for drafter, k, batch in (
        (DraftModelDrafter(LlamaCppRunner(gguf_d)), 2, 1),
        (DraftModelDrafter(LlamaCppRunner(gguf_d)), 4, 3),
        (DraftModelDrafter(LlamaCppRunner(gguf_d)), 8, 1),
        (NgramDrafter(), 4, 3),
    ):
        outs, drafted = run(drafter, k, batch)
        assert drafted > 0
        assert outs == ref, (type(drafter).__name__, k, batch)


def test_generate_batch_invariant_on_llamacpp(tiny, capsys):
    """``--batch-invariant on`` on llama.cpp (the target loaded without repack): the same greedy tokens, drafted."""
    _, _, gt, gd, _ = tiny
    base = [
        "generate",
        "--backend",
        "llamacpp",
        "--target",
        str(gt.path),
        "--draft",
        str(gd.path),
        "--prompt",
        "xyxyx",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    runs = []
    for extra in ([], ["--batch-invariant", "on"]):
        code, out, err = _cli(base + extra, capsys)
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[1]["stats"]["drafted"] > 0, runs[1]
