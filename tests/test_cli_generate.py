"""`specdecode generate` end to end on tiny models saved to local directories."""

import json

import pytest

from specdecode.cli import main
from tiny import make_model, make_tokenizer, perturbed_copy

V = 32


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = make_tokenizer(V)
    # llama architecture: for a qwen2 config transformers swaps in Qwen2Tokenizer, which adds tokens
    target = make_model(V, seed=0, arch="llama")
    dirs = {}
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.1))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = str(root / name)
    other = make_model(V + 4, seed=1, arch="llama")  # a different vocabulary
    other.save_pretrained(root / "other")
    make_tokenizer(V + 4).save_pretrained(root / "other")
    dirs["other"] = str(root / "other")
    return dirs


def run(capsys, *argv):
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_speculative_json_output_equals_target_only(model_dirs, capsys):
    common = [
        "--target",
        model_dirs["target"],
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--json",
    ]
    code, base, _ = run(capsys, *common)
    assert code == 0
    code, spec, _ = run(capsys, *common, "--draft", model_dirs["draft"], "-k", "3")
    assert code == 0
    base, spec = json.loads(base), json.loads(spec)
    assert spec["token_ids"] == base["token_ids"] and len(spec["token_ids"]) == 12
    assert spec["finish_reason"] == "length"
    assert spec["stats"]["drafted"] > 0 and base["stats"]["drafted"] == 0
    assert spec["text"] == make_tokenizer(V).decode(spec["token_ids"], skip_special_tokens=True)


def test_draft_confidence_and_policy_flags_keep_the_greedy_output(model_dirs, capsys):
    common = [
        "--target",
        model_dirs["target"],
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--json",
    ]
    _, base, _ = run(capsys, *common)
    code, spec, _ = run(
        capsys,
        *common,
        "--draft",
        model_dirs["draft"],
        "-k",
        "4",
        "--draft-policy",
        "acceptance",
        "--draft-confidence",
        "0.6",
    )
    assert code == 0 and json.loads(spec)["token_ids"] == json.loads(base)["token_ids"]


def test_auto_policy_over_two_drafters_keeps_the_greedy_output_and_reports_its_choices(
    model_dirs, capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    common = [
        "--target",
        model_dirs["target"],
        "--prompt-ids",
        "1,2,3,1,2,3,1,2",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--dtype",
        "float32",
    ]
    _, base, _ = run(capsys, *common, "--json")
    auto = [
        *common,
        "--draft",
        model_dirs["draft"],
        "--draft",
        "ngram",
        "--draft-policy",
        "auto",
        "--max-draft-tokens",
        "4",
    ]
    code, spec, err = run(capsys, *auto, "--json")
    assert code == 0 and "calibrating step costs" in err, err
    out = json.loads(spec)
    assert out["token_ids"] == json.loads(base)["token_ids"]
    choices = out["stats"]["choices"]
    assert sum(choices.values()) == out["stats"]["target_steps"]
    assert all(label == "off" or label.split(":")[0] in ("draft", "ngram") for label in choices), choices
    code, _, err = run(capsys, *auto)  # the summary line names the choices; the costs come from the cache now
    assert code == 0 and "chose " in err and "calibrating" not in err, err


def test_verify_budget_turns_drafting_off_for_a_full_batch(model_dirs, capsys):
    argv = [
        "--target",
        model_dirs["target"],
        "--draft",
        model_dirs["draft"],
        "-k",
        "3",
        "--prompt-ids",
        "1,2,3",
        "--num-samples",
        "3",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--json",
    ]
    _, free, _ = run(capsys, *argv)
    code, capped, _ = run(capsys, *argv, "--verify-budget", "3")  # 3 // 3 - 1 = 0 draft tokens each
    assert code == 0
    free, capped = [[json.loads(line) for line in out.splitlines()] for out in (free, capped)]
    assert [c["token_ids"] for c in capped] == [f["token_ids"] for f in free]
    assert all(c["stats"]["drafted"] == 0 for c in capped) and all(f["stats"]["drafted"] > 0 for f in free)


def test_num_samples_are_independent_and_seeded(model_dirs, capsys):
    argv = [
        "--target",
        model_dirs["target"],
        "--draft",
        model_dirs["draft"],
        "--prompt",
        "abc",
        "--temperature",
        "1.0",
        "--seed",
        "5",
        "--num-samples",
        "3",
        "--max-new-tokens",
        "10",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--json",
    ]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    first = [json.loads(line)["token_ids"] for line in out.splitlines()]
    assert len(first) == 3 and len({tuple(t) for t in first}) > 1
    _, again, _ = run(capsys, *argv)
    assert [json.loads(line)["token_ids"] for line in again.splitlines()] == first


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["-k", "-2"], "num-draft-tokens"),
        (["--draft-confidence", "1.5"], "confidence"),
        (["--verify-budget", "-1"], "verify-budget"),
        (["--prompt-ids", "1,x"], None),
    ],
)
def test_bad_arguments_get_clear_errors(model_dirs, capsys, bad, message):
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "float32"]
    if "--prompt-ids" not in bad:
        argv += ["--prompt-ids", "1,2"]
    try:
        code, _, err = run(capsys, *argv, *bad)
    except SystemExit as exc:  # argparse-level errors
        code, err = 2, str(exc)
    assert code == 2
    if message:
        assert message in err


def test_mismatched_vocabularies_are_refused(model_dirs, capsys):
    code, _, err = run(
        capsys,
        "--target",
        model_dirs["target"],
        "--draft",
        model_dirs["other"],
        "--prompt-ids",
        "1,2",
        "--dtype",
        "float32",
    )
    assert code == 2 and "cannot draft for target" in err


def test_target_quantization_is_labelled_lossy_and_speculation_stays_exact_for_that_target(model_dirs, capsys):
    common = [
        "--target",
        model_dirs["target"],
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--json",
        "--target-quantization",
        "int8",
    ]
    code, base, err = run(capsys, *common)
    assert code == 0 and "LOSSY" in err
    code, spec, _ = run(capsys, *common, "--draft", model_dirs["draft"], "-k", "3")
    base, spec = json.loads(base), json.loads(spec)
    assert base["lossy"] is True and base["target_quantization"] == "int8"
    assert spec["token_ids"] == base["token_ids"]  # exact for the quantized target
    code, plain, _ = run(capsys, *common[:-2])
    assert json.loads(plain)["lossy"] is False


def test_text_streams_as_tokens_are_accepted_then_a_timed_summary(model_dirs, monkeypatch, capsys):
    import sys

    import specdecode.engine as engine_mod

    writes, steps = [], []
    real_step = engine_mod.Engine.step

    def step(self):  # record the order of engine steps and stdout writes
        steps.append(len(writes))
        return real_step(self)

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(engine_mod.Engine, "step", step)
    monkeypatch.setattr(sys, "stdout", Recorder())
    code = main(
        [
            "generate",
            "--target",
            model_dirs["target"],
            "--prompt",
            "abc",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--dtype",
            "float32",
            "--draft",
            model_dirs["draft"],
            "-k",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    text_writes = [w for w in writes if w.strip()]
    assert len(text_writes) >= 3  # one write per step with new text, not one at the end
    assert steps[-1] > 0  # text was written before the last step ran
    for field in ("tok/s", "time to first token", "prefill", "decode", "acceptance", "tokens/step"):
        assert field in err, field


@pytest.mark.parametrize(
    "argv,culprit",
    [
        (["-k", "-1"], "num-draft-tokens"),
        (["--prompt", ""], "--prompt is empty"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--draft", "medusa:"], "medusa:DIR"),
    ],
)
def test_bad_arguments_fail_before_any_model_loads(model_dirs, monkeypatch, capsys, argv, culprit):
    import specdecode.models.loading as loading

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", no_loading)
    base = ["--target", model_dirs["target"], "--prompt", "abc", "--dtype", "float32"]
    if "--draft" not in argv:
        base += ["--draft", model_dirs["draft"]]
    code, _, err = run(capsys, *base, *argv)
    assert code == 2 and "Traceback" not in err and culprit in err, err
