"""`specdecode bench` end to end on tiny models: outputs, the report, resume, the greedy check, bad input."""

import argparse
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from specdecode.bench import cli
from specdecode.bench import runner as R
from specdecode.sampling import SamplingSetting
from tiny import make_model, make_tokenizer, perturbed_copy

V = 40  # rows for the tokenizer's 32 tokens and the <|endoftext|> that saving/loading adds


@pytest.fixture(autouse=True)
def _restore_threads():
    """The runs below use ``--threads 1`` (steady on a busy CI box); give other tests their threads back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tok = make_tokenizer(32)
    target = make_model(V, seed=0)
    for name, model in (("target", target), ("draft", perturbed_copy(target, noise=0.15))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    rows = [{"id": f"p{i}", "category": ("code", "chat")[i % 2], "prompt": "abcdefghij"[: 3 + i]} for i in range(4)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"target": root / "target", "draft": root / "draft", "prompts": root / "prompts.jsonl"}


def bench_args(models, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(
        [
            "--target",
            str(models["target"]),
            "--draft",
            str(models["draft"]),
            "--dtype",
            "float32",
            "--prompts",
            str(models["prompts"]),
            "--draft-lengths",
            "1,3",
            "--max-new-tokens",
            "10",
            "--no-progress",
            "--warmup-tokens",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_full_run_writes_records_report_and_plots(models, tmp_path):
    out = tmp_path / "out"
    assert cli.main(bench_args(models, out, "--sampling", "greedy,t0.7-p0.95")) == 0
    recs = read_records(out)
    runs = [r for r in recs if r["type"] == "run"]
    # 4 prompts x 2 samplings x (target, spec-k1, spec-k3, hf, hf-assisted) x 1 repeat
    assert len(runs) == 4 * 2 * 5
    assert all(r["new_tokens"] == 10 for r in runs)  # EOS ignored everywhere: equal work
    spec = [r for r in runs if r["config"] == "spec-k3"]
    assert all(len(r["steps"]) == r["stats"]["target_steps"] for r in spec)
    assert all(sum(s[1] for s in r["steps"]) == 10 for r in spec)

    checks = [r for r in recs if r["type"] == "check"]
    assert len(checks) == 4 * 4  # greedy only: every non-target config of every prompt
    spec_checks = [c for c in checks if c["config"].startswith("spec")]
    assert spec_checks and all(c["match"] for c in spec_checks)  # float32, lossless

    for name in (
        "report.md",
        "results.json",
        "meta.json",
        "speedup_vs_k.png",
        "acceptance_by_position.png",
        "speedup_vs_context.png",
        "predicted_vs_measured.png",
    ):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["commit"] and results["meta"]["versions"]["torch"]
    assert len([r for r in results["records"] if r["type"] == "run"]) == len(runs)
    report = (out / "report.md").read_text()
    overall = next(
        c
        for c in results["summary"]["cells"]
        if (c["sampling"], c["config"], c["group"]) == ("greedy", "spec-k3", "overall")
    )
    assert f"| spec-k3 | 4 | {overall['tok_s']:.3f} | {overall['speedup']:.2f} |" in report
    for heading in (
        "## Results: greedy",
        "## Results: t0.7-p0.95",
        "## Break-even: code",
        "Latency: time to the last token",
        "Per request: tokens per decode step",
        "Against `transformers`",
        "Greedy exactness",
        "## Definitions",
    ):
        assert heading in report

    # the report rebuilt from the records alone: no --target (the stored run names its models)
    (out / "report.md").unlink()
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.main(parser.parse_args(["--out", str(out), "--report-only"])) == 0
    assert (out / "report.md").read_text() == report


def test_interrupted_run_resumes_without_recomputing(models, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = R.BenchRunner.run_one
    calls: list[tuple] = []
    interrupt_at = [7]

    def counting(self, prompt, repeat, sampling, config):
        calls.append((prompt.id, sampling.name, config.name, repeat))
        if len(calls) == interrupt_at[0]:
            os.kill(os.getpid(), signal.SIGTERM)  # like `kill` on a background run (Ctrl-C takes the same path)
        return real(self, prompt, repeat, sampling, config)

    monkeypatch.setattr(R.BenchRunner, "run_one", counting)
    args = bench_args(models, out, "--baselines", "none", "--warmup-tokens", "0", "--repeats", "2")
    assert cli.main(args) == 130
    first = [r for r in read_records(out) if r["type"] == "run"]
    assert len(first) == 6
    assert "Incomplete" in (out / "report.md").read_text()

    calls.clear()
    interrupt_at[0] = None
    assert cli.main(args) == 0
    total = 4 * 2 * 3  # prompts x repeats x (target, spec-k1, spec-k3)
    assert len(calls) == total - 6  # nothing finished was run again
    runs = [r for r in read_records(out) if r["type"] == "run"]
    keys = [(r["prompt_id"], r["config"], r["repeat"]) for r in runs]
    assert len(runs) == total and len(set(keys)) == total
    assert runs[:6] == first
    sessions = [r for r in read_records(out) if r["type"] == "session"]
    assert [s["interrupted"] for s in sessions] == [True, False]
    assert "Incomplete" not in (out / "report.md").read_text()


def test_interleaving_rotates_the_order():
    prompts = [R.BenchPrompt(f"p{i}", "c", "completion", [1, 2], 4) for i in range(3)]
    configs = R.make_configs([1, 2], [])
    runner = R.BenchRunner(None, prompts, configs, [R.bench_setting("greedy")], 1, None, progress=False)
    firsts = [t[4].name for t in runner.plan() if t[0] == 0][:1] + [
        next(t[4].name for t in runner.plan() if t[0] == i) for i in (1, 2)
    ]
    assert firsts == ["target", "spec-k1", "spec-k2"]


def test_mismatch_reports_the_logit_margin():
    logits = torch.zeros(8)
    logits[3], logits[5] = 10.0, 9.95  # a near-tie between 3 and 5
    backend = R.Backend(None, None, lambda ids: logits, [], 2**-7)
    runner = R.BenchRunner(backend, [], [], [], 1, None, progress=False)
    prompt = R.BenchPrompt("p", "c", "completion", [1, 2], 4)
    rec = runner.compare(prompt, "greedy", "spec-k2", 0, [7, 3, 1], [7, 5, 1])
    assert not rec["match"] and rec["first_diff"] == 1
    assert rec["expected_token"] == 3 and rec["got_token"] == 5
    assert rec["logit_gap"] == pytest.approx(0.05, abs=1e-5) and rec["top2_margin"] == pytest.approx(0.05, abs=1e-5)
    assert rec["near_tie"]
    logits[5] = 7.0
    assert not runner.compare(prompt, "greedy", "spec-k2", 0, [7, 3, 1], [7, 5, 1])["near_tie"]
    assert runner.compare(prompt, "greedy", "spec-k2", 0, [7, 3], [7, 3])["match"]


def _fails(capsys, args, *needles):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_bad_input_errors_name_the_problem_and_keep_finished_runs(models, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(bench_args(models, out, "--baselines", "none", "--draft-lengths", "2")) == 0
    before = (out / "records.jsonl").read_text()

    missing = tmp_path / "nope" / "question.jsonl"
    _fails(
        capsys,
        bench_args(models, out, "--prompts", "spec-bench", "--spec-bench-path", str(missing)),
        "Spec-Bench question.jsonl not found",
        str(missing),
    )
    spec_bench = tmp_path / "question.jsonl"
    spec_bench.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    _fails(
        capsys,
        bench_args(
            models, out, "--prompts", "spec-bench", "--spec-bench-path", str(spec_bench), "--categories", "poetry"
        ),
        "unknown category ['poetry']",
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "abc"}\n{"prompt": "ab\n')
    _fails(capsys, bench_args(models, out, "--prompts", str(broken)), f"{broken}:2: invalid JSON")
    _fails(
        capsys,
        bench_args(models, out, "--max-context", "14"),
        "do not fit the context of 14 tokens",
        "p2 (5 + 10 tokens)",
        "--skip-too-long",
    )
    _fails(capsys, bench_args(models, out, "--sampling", "hot"), "unknown sampling setting 'hot'")
    _fails(
        capsys,
        bench_args(models, out, "--max-new-tokens", "11"),
        "other settings (max_new_tokens: 10 -> 11)",
        "another --out",
    )
    assert (out / "records.jsonl").read_text() == before


def test_too_long_prompts_can_be_skipped(models, tmp_path, capsys):
    out = tmp_path / "out"
    args = bench_args(
        models, out, "--max-context", "14", "--skip-too-long", "--baselines", "none", "--draft-lengths", "1"
    )
    assert cli.main(args) == 0
    assert "skipped 2 prompt(s)" in capsys.readouterr().err
    assert {r["prompt_id"] for r in read_records(out) if r["type"] == "run"} == {"p0", "p1"}


def test_sampling_settings_and_configs_parse():
    assert R.bench_setting("greedy") == SamplingSetting(0.0)
    assert R.bench_setting("t0.7-p0.95") == SamplingSetting(0.7, 0, 0.95, label="t0.7-p0.95")
    assert R.bench_setting("t1.0") == SamplingSetting(1.0, 0, 1.0, label="t1.0")
    assert [R.bench_setting(s).name for s in ("greedy", "t0.7-p0.95", "t1.0")] == ["greedy", "t0.7-p0.95", "t1.0"]
    for bad in ("t0", "t0.7-p1.5", "hot", "t-1", "t=0.7", "k=20"):
        with pytest.raises(R.BenchInputError):
            R.bench_setting(bad)
    assert [c.name for c in R.make_configs([2, 4], ["hf"])] == ["target", "spec-k2", "spec-k4", "hf"]
    with pytest.raises(R.BenchInputError, match="draft lengths must be >= 1"):
        R.make_configs([0], [])
    with pytest.raises(R.BenchInputError, match="unknown baseline 'vllm'"):
        R.make_configs([1], ["vllm"])


def test_draft_schedule_is_recorded_and_a_resume_with_another_one_is_refused(models, tmp_path, capsys):
    out = tmp_path / "out"
    common = ("--baselines", "none", "--warmup-tokens", "0", "--draft-lengths", "2", "--sampling", "greedy", "-n", "1")
    args = bench_args(models, out, *common)
    assert cli.main(bench_args(models, out, *common, "--draft-policy", "acceptance", "--draft-confidence", "0.3")) == 0
    report = (out / "report.md").read_text()
    assert (
        "draft length of spec-k<k>: acceptance policy starting at k, up to 16; chains end below draft "
        "confidence 0.3" in report
    )
    capsys.readouterr()
    assert cli.main(args) == 2  # plain fixed k into the same directory would mix two schedules
    assert "draft_schedule" in capsys.readouterr().err


def test_tree_configs_run_beside_chains_and_are_checked(models, tmp_path):
    out = tmp_path / "trees"
    assert cli.main(bench_args(models, out, "--draft-lengths", "3", "--tree-shapes", "2x4", "--baselines", "none")) == 0
    runs = [r for r in read_records(out) if r["type"] == "run"]
    assert {r["config"] for r in runs} == {"target", "spec-k3", "spec-k3-t2n4"}
    tree = [r for r in runs if r["config"] == "spec-k3-t2n4"]
    assert all(len(step) == 6 and step[5] >= step[2] for r in tree for step in r["steps"])  # nodes >= depth
    assert any(step[5] > step[2] for r in tree for step in r["steps"])  # some steps were real trees
    checks = [r for r in read_records(out) if r["type"] == "check" and r["config"] == "spec-k3-t2n4"]
    assert len(checks) == 4 and all(c["match"] for c in checks)  # greedy trees equal target-only
    assert "| spec-k3-t2n4 | 4 |" in (out / "report.md").read_text()


def test_bounded_draft_contexts_run_beside_the_whole_prompt_and_are_checked(models, tmp_path):
    out = tmp_path / "contexts"
    assert (
        cli.main(bench_args(models, out, "--draft-lengths", "3", "--draft-contexts", "4", "--baselines", "none")) == 0
    )
    runs = [r for r in read_records(out) if r["type"] == "run"]
    assert {r["config"] for r in runs} == {"target", "spec-k3", "spec-k3-ctx4"}
    assert sum(step[2] for r in runs if r["config"] == "spec-k3-ctx4" for step in r["steps"]) > 0  # it drafted
    checks = [r for r in read_records(out) if r["type"] == "check" and r["config"] == "spec-k3-ctx4"]
    assert checks and all(c["match"] for c in checks)  # greedy with the window equals target-only
    assert [c.name for c in R.make_configs([2, 4], [], contexts=[64])] == [
        "target",
        "spec-k2",
        "spec-k2-ctx64",
        "spec-k4",
        "spec-k4-ctx64",
    ]


def test_bad_tree_shapes_are_refused():
    with pytest.raises(R.BenchInputError, match="tree shape"):
        R.make_configs([3], [], ["3"])
    with pytest.raises(R.BenchInputError, match="tree shape"):
        R.make_configs([3], [], ["1x4"])


def test_draft_quantizations_sweep_side_by_side(models, tmp_path):
    out = tmp_path / "quant"
    assert (
        cli.main(
            bench_args(models, out, "--draft-lengths", "3", "--draft-quantization", "none,int8", "--baselines", "none")
        )
        == 0
    )
    runs = [r for r in read_records(out) if r["type"] == "run"]
    assert {r["config"] for r in runs} == {"target", "spec-k3", "spec-k3@int8"}
    checks = [r for r in read_records(out) if r["type"] == "check" and r["config"] == "spec-k3@int8"]
    assert len(checks) == 4 and all(c["match"] for c in checks)
    assert "| spec-k3@int8 | 4 |" in (out / "report.md").read_text()


def test_extra_drafters_run_in_the_same_interleaved_run(models, tmp_path):
    from transformers import AutoModelForCausalLM

    from test_medusa import tiny_heads

    heads_dir = tmp_path / "heads"
    tiny_heads(AutoModelForCausalLM.from_pretrained(models["target"])).save(heads_dir)
    out = tmp_path / "extra"
    assert (
        cli.main(
            bench_args(
                models,
                out,
                "--draft-lengths",
                "3",
                "--tree-shapes",
                "2x4",
                "--baselines",
                "none",
                "--extra-draft",
                f"medusa:{heads_dir}",
                "--extra-draft",
                "ngram",
            )
        )
        == 0
    )
    runs = [r for r in read_records(out) if r["type"] == "run"]
    assert {r["config"] for r in runs} == {
        "target",
        "spec-k3",
        "spec-k3-t2n4",
        "spec-k3[medusa]",
        "spec-k3-t2n4[medusa]",
        "spec-k3[ngram]",
        "spec-k3-t2n4[ngram]",
    }
    assert sum(r["stats"]["drafted"] for r in runs if r["config"] == "spec-k3[medusa]") > 0
    checks = [r for r in read_records(out) if r["type"] == "check" and "[" in r["config"]]
    assert len(checks) == 16 and all(c["match"] for c in checks)
    report = (out / "report.md").read_text()
    assert "| spec-k3[medusa] | 4 |" in report and "| spec-k3-t2n4[medusa] | 4 |" in report
    with pytest.raises(R.BenchInputError, match="names the same draft model"):
        cli._prepare(
            bench_args(models, tmp_path / "bad", "--extra-draft", str(models["draft"])), {}, [], [], [], None, None
        )
    assert [c.name for c in R.make_configs([2], [], extra_drafts=["ngram", "ngram:4"], main_draft=False)] == [
        "target",
        "spec-k2[ngram]",
        "spec-k2[ngram2]",
    ]


def test_an_extra_drafter_may_name_its_own_lengths_and_trees():
    names = [
        c.name for c in R.make_configs([4], [], ["2x8"], extra_drafts=["ngram|k=2|trees=none", "ngram:4|trees=4x16"])
    ]
    assert names == ["target", "spec-k4", "spec-k4-t2n8", "spec-k4[ngram2]", "spec-k4-t4n16[ngram2]", "spec-k2[ngram]"]
    configs = R.make_configs([4], [], extra_drafts=["ngram|k=2|trees=none"], main_draft=False)
    assert [(c.name, c.draft) for c in configs] == [("target", None), ("spec-k2[ngram]", "ngram")]
    for bad in ("ngram|k=x", "ngram|depth=3", "ngram|trees=1x4", "ngram|k="):
        with pytest.raises(R.BenchInputError):
            R.make_configs([4], [], extra_drafts=[bad])


def test_auto_policy_runs_beside_every_fixed_configuration_it_chooses_from(models, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "auto"
    assert (
        cli.main(
            bench_args(
                models,
                out,
                "--draft-lengths",
                "3",
                "--baselines",
                "none",
                "--draft",
                "ngram",
                "--draft-policy",
                "auto",
                "--max-draft-tokens",
                "4",
                "--max-new-tokens",
                "16",
            )
        )
        == 0
    )
    runs = [r for r in read_records(out) if r["type"] == "run"]
    assert {r["config"] for r in runs} == {"target", "spec-k3", "spec-k3[ngram]", "auto"}
    auto = [r for r in runs if r["config"] == "auto"]
    assert all(sum(r["stats"]["choices"].values()) == r["stats"]["target_steps"] for r in auto)
    fixed = [r for r in runs if r["config"] == "spec-k3"]
    assert all(not r["stats"]["choices"] for r in fixed)  # the fixed configs stay fixed
    checks = [r for r in read_records(out) if r["type"] == "check" and r["config"] == "auto"]
    assert len(checks) == 4 and all(c["match"] for c in checks)
    report = (out / "report.md").read_text()
    assert "| auto | 4 |" in report and "## What --draft-policy auto chose" in report
    why = auto[-1]["policy"]  # what its choices rested on: the costs and each drafter's acceptance
    assert (why["calibration"] in ("quiet", "busy") and set(why["drafters"]) == {"spec", "ngram"}) or why["drafters"]
    assert all({"alpha", "tried", "speed_vs_plain", "best_k"} <= set(x) for x in why["drafters"].values())
    assert not any("policy" in r for r in fixed)


def test_a_configuration_that_never_drafted_gets_no_verdict_and_auto_says_why(models, tmp_path, monkeypatch):
    """The report judges speculation only by configurations that drafted; where ``auto`` decoded plainly,
    it shows the costs and acceptance that made it (the records of a real run, auto's made plain)."""
    from specdecode.bench import report

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "auto"
    assert (
        cli.main(
            bench_args(
                models,
                out,
                "--draft-lengths",
                "3",
                "--baselines",
                "none",
                "--draft",
                "ngram",
                "--draft-policy",
                "auto",
                "--max-draft-tokens",
                "4",
                "--max-new-tokens",
                "16",
            )
        )
        == 0
    )
    records = read_records(out)
    for r in records:
        if r.get("type") == "run" and r["config"] != "target":  # as if nothing had drafted
            steps = r["stats"]["target_steps"]
            r["stats"].update(drafted=0, accepted=0, choices={"off": steps} if r["config"] == "auto" else {})
            r["stats"]["accepted_by_position"] = [0] * len(r["stats"].get("accepted_by_position", []))
            r["steps"] = [[ctx, 1, 0, 0, sec, 0] for ctx, _, _, _, sec, _ in r["steps"]]
    text = (
        report.write_report(tmp_path / "plain", records, json.loads((out / "meta.json").read_text()))
        and (tmp_path / "plain" / "report.md").read_text()
    )
    assert "Why `auto` decoded plainly in 100% of its greedy steps" in text and "| ngram |" in text
    verdicts = [line for line in text.splitlines() if line.startswith("- greedy:")]
    assert verdicts and all("no configuration drafted" in line for line in verdicts), verdicts


def test_only_runs_the_named_configurations_beside_target(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "only"
    auto = (
        "--draft-lengths",
        "3",
        "--baselines",
        "none",
        "--draft",
        "ngram",
        "--draft-policy",
        "auto",
        "--max-draft-tokens",
        "4",
        "--max-new-tokens",
        "16",
    )
    assert cli.main(bench_args(models, out, *auto, "--only", "auto")) == 0
    runs = [r for r in read_records(out) if r["type"] == "run"]
    assert {r["config"] for r in runs} == {"target", "auto"}  # the fixed ones auto chooses from: not run
    assert sum(r["stats"]["drafted"] for r in runs if r["config"] == "auto") > 0  # auto drafted
    checks = [r for r in read_records(out) if r["type"] == "check" and r["config"] == "auto"]
    assert len(checks) == 4 and all(c["match"] for c in checks)
    before = (out / "records.jsonl").read_text()
    _fails(
        capsys,
        bench_args(models, out, *auto, "--only", "auto,spec-k9"),
        "--only spec-k9",
        "target, spec-k3, spec-k3[ngram], auto",
    )
    assert (out / "records.jsonl").read_text() == before


def test_memory_check_runs_a_speculative_request_and_reports_the_peak(models):
    """`bench --memory-check`: one batch-1 request at the asked context, with the draft at k."""
    from specdecode.bench.memory import measure

    result = measure(str(models["target"]), str(models["draft"]), "float32", context=48, k=3, new_tokens=8)
    assert result["k"] == 3 and result["new_tokens"] == 8 and result["prompt_tokens"] == 40
    assert result["draft"] == str(models["draft"]) and result["acceptance_rate"] is not None
    assert result["peak_rss_gib"] > 0 and result["weights_gib"] > 0


def test_coupled_sampler_bench_runs_equal_target_only_and_the_report_says_so(models, tmp_path):
    """With --sampler coupled a seeded run's tokens depend on (seed, target, prompt) alone: at T = 1 every
    speculative run equals the target-only run of the same prompt and repeat, while drafting was exercised."""
    out = tmp_path / "out"
    assert cli.main(bench_args(models, out, "--sampling", "t1.0", "--baselines", "none", "--sampler", "coupled")) == 0
    runs = [r for r in read_records(out) if r["type"] == "run"]
    target = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in runs if r["config"] == "target"}
    spec = [r for r in runs if r["config"] != "target"]
    assert spec and all(r["token_ids"] == target[(r["prompt_id"], r["repeat"])] for r in spec)
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    assert "- sampler: **coupled**" in (out / "report.md").read_text()


def test_command_line_names_the_script_or_the_cli(monkeypatch):
    """A benchmark script's results name ``python <script> ...`` (relative to the repository), the CLI's
    ``specdecode ...``: the command a reader reruns."""
    from pathlib import Path

    from specdecode.bench import env

    root = Path(env.__file__).resolve().parents[2]
    monkeypatch.setattr("sys.argv", [str(root / "docs/bench/coupled/sampler_cost.py"), "--prompts", "2"])
    assert env.command_line() == "python docs/bench/coupled/sampler_cost.py --prompts 2"
    monkeypatch.setattr("sys.argv", ["/usr/bin/specdecode", "bench", "--out", "a b"])
    assert env.command_line() == "specdecode bench --out 'a b'"


def _suffix_args(models, out: Path, *extra: str) -> argparse.Namespace:
    """Repetitive prompts the suffix drafter drafts from, two repeats: what a cross-request history changes."""
    rows = [{"id": f"r{i}", "category": "code", "prompt": "abcabcabc"[i:] + "abcd" * (i + 1)} for i in range(3)]
    prompts = out.parent / f"{out.name}-prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(
        [
            "--target",
            str(models["target"]),
            "--draft",
            "suffix",
            "--dtype",
            "float32",
            "--prompts",
            str(prompts),
            "--draft-lengths",
            "4",
            "--max-new-tokens",
            "24",
            "--baselines",
            "none",
            "--repeats",
            "2",
            "--no-progress",
            "--warmup-tokens",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


def _drafting(out: Path) -> dict[tuple[str, int], tuple[int, int, int]]:
    return {
        (r["prompt_id"], r["repeat"]): (r["stats"]["target_steps"], r["stats"]["drafted"], r["stats"]["accepted"])
        for r in read_records(out)
        if r["type"] == "run" and r["config"] == "spec-k4"
    }


def test_repeats_are_replicates_a_history_never_drafts_from_its_own_earlier_output(models, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert cli.main(_suffix_args(models, out)) == 0
    runs = _drafting(out)
    assert all(runs[(p, 0)][1] > 0 for p in ("r0", "r1", "r2"))  # the suffix drafter drafted
    assert all(runs[(p, 1)] == runs[(p, 0)] for p in ("r0", "r1", "r2"))  # each repeat drafted as the first did
    assert all(c["match"] for c in read_records(out) if c["type"] == "check")

    # negative control: an engine that keeps outputs across passes drafts a repeat from its own earlier output
    from specdecode.engine import Engine

    monkeypatch.setattr(Engine, "forget_outputs", lambda self: None)
    leaky = tmp_path / "leaky"
    assert cli.main(_suffix_args(models, leaky)) == 0
    runs = _drafting(leaky)
    assert any(runs[(p, 1)][2] > runs[(p, 0)][2] for p in ("r0", "r1", "r2"))  # more accepted: it read the answer


def test_a_resumed_run_replays_the_outputs_it_skips(models, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    assert cli.main(_suffix_args(models, whole)) == 0
    real = R.BenchRunner.run_one
    calls: list[tuple] = []

    def interrupted(self, prompt, repeat, sampling, config):
        calls.append((prompt.id, config.name, repeat))
        if len(calls) == 11:  # 2 warm-ups, pass 0 (3 prompts x 2 configs), then pass 1's r0: stop at its r1
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, prompt, repeat, sampling, config)

    def resumed(out: Path) -> dict:
        calls.clear()
        monkeypatch.setattr(R.BenchRunner, "run_one", interrupted)
        assert cli.main(_suffix_args(models, out)) == 130
        assert {(p, r) for p, _, r in calls[2:10]} == {("r0", 0), ("r1", 0), ("r2", 0), ("r0", 1)}
        monkeypatch.setattr(R.BenchRunner, "run_one", real)
        assert cli.main(_suffix_args(models, out)) == 0
        return _drafting(out)

    assert resumed(tmp_path / "out") == _drafting(whole)
    # negative control: without the replay, the rest of pass 1 drafts without r0's output in its history
    from specdecode.engine import Engine

    monkeypatch.setattr(Engine, "remember", lambda self, output: None)
    assert resumed(tmp_path / "forgetful") != _drafting(whole)
