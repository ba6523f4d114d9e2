"""`specdecode load` end to end against fake servers on 127.0.0.1: outputs, comparison, errors,
Ctrl-C."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_openai import Behaviour, FakeServer

from specdecode.load import cli
from specdecode.load.stats import crossover


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(argv))


def _prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):"}, {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_compare_two_endpoints_writes_every_output(tmp_path: Path) -> None:
    # "on" is faster alone but slows down with every other stream in flight. Which endpoint wins at
    # a level is measured in wall-clock time, which a busy machine can skew either way, so the
    # comparison is checked against the summary's own numbers (stats.compare and stats.crossover
    # have exact unit tests in test_load_stats.py). Level and run limits and the TTFT target are far
    # beyond anything an answered request needs.
    off = Behaviour(first_token_s=0.03, token_interval_s=0.03)
    on = Behaviour(
        first_token_s=0.03,
        token_interval_s=0.008,
        slowdown_s=0.03,
        speculation={"drafted": 6, "accepted": 3, "acceptance_rate": 0.5, "tokens_per_step": 1.5},
    )
    out = tmp_path / "out"
    with FakeServer(off) as off_server, FakeServer(on) as on_server:
        rc = _run(
            [
                "--endpoint",
                f"off={off_server.url}",
                "--endpoint",
                f"on={on_server.url}/v1",
                "--prompts",
                str(_prompt_file(tmp_path)),
                "--levels",
                "1,4",
                "--num-requests",
                "4",
                "--output-len",
                "6",
                "--slo-ttft-ms",
                "600000",
                "--duration",
                "600",
                "--time-limit",
                "3600",
                "--endpoint-body",
                'on={"speculate": true}',
                "--extra-body",
                '{"seed": 1}',
                "--no-progress",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    assert {p.name for p in out.iterdir()} == {
        "requests.jsonl",
        "summary.json",
        "report.md",
        "throughput.png",
        "latency.png",
    }
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["error"] is None for r in rows)
    assert [(r["endpoint"], r["level"]) for r in rows[::4]] == [("off", 1), ("on", 1), ("off", 4), ("on", 4)]
    assert on.bodies[0]["speculate"] is True and "speculate" not in off.bodies[0]
    assert off.bodies[0]["seed"] == on.bodies[0]["seed"] == 1
    summary = json.loads((out / "summary.json").read_text())
    comparison = summary["comparison"]
    assert comparison["levels"] == [1, 4]
    level = {(s["label"], s["level"]): s for s in summary["levels"]}
    assert set(level) == {("off", 1), ("on", 1), ("off", 4), ("on", 4)}
    ratios = [level["on", n]["output_throughput"] / level["off", n]["output_throughput"] for n in (1, 4)]
    assert comparison["ratios"]["output_throughput"] == pytest.approx(ratios)  # candidate / baseline
    point = crossover([1, 4], ratios)
    assert comparison["crossover"]["output_throughput"] == point
    on_levels = [s for s in summary["levels"] if s["label"] == "on"]
    assert on_levels[0]["speculation"]["acceptance_rate"] == 0.5
    assert on_levels[0]["goodput"] == pytest.approx(on_levels[0]["request_throughput"])
    report = (out / "report.md").read_text()
    where = "no crossover in the tested range" if point is None else f"at concurrency {point:g}"
    assert "## on / off" in report and f"output tok/s: {where}" in report
    assert "**TPOT**" in report


def test_three_endpoints_are_interleaved_and_each_candidate_is_compared_with_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fast, slow = (
        Behaviour(first_token_s=0.01, token_interval_s=0.01),
        Behaviour(first_token_s=0.02, token_interval_s=0.02),
    )
    with FakeServer(slow) as a, FakeServer(fast) as b, FakeServer(fast) as c:
        rc = _run(
            [
                "--endpoint",
                a.url,
                "--endpoint",
                b.url,
                "--endpoint",
                c.url,
                "--prompts",
                str(_prompt_file(tmp_path)),
                "--levels",
                "1,2",
                "--num-requests",
                "2",
                "--output-len",
                "4",
                "--duration",
                "600",
                "--time-limit",
                "3600",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [(r["endpoint"], r["level"]) for r in rows[::2]] == [
        ("A", 1),
        ("B", 1),
        ("C", 1),
        ("A", 2),
        ("B", 2),
        ("C", 2),
    ]
    summary = json.loads((out / "summary.json").read_text())
    pairs = [(c["baseline"], c["candidate"]) for c in summary["comparisons"]]
    assert pairs == [("A", "B"), ("A", "C")] and summary["comparison"]["candidate"] == "B"
    level = {(s["label"], s["level"]): s for s in summary["levels"]}
    for comparison in summary["comparisons"]:
        cand = comparison["candidate"]
        assert comparison["ratios"]["ttft.p50"] == pytest.approx(
            [level[cand, n]["ttft"]["p50"] / level["A", n]["ttft"]["p50"] for n in (1, 2)]
        )
    report = (out / "report.md").read_text()
    assert "## B / A" in report and "## C / A" in report


def test_rounds_alternate_endpoints_within_a_level_and_the_report_pairs_requests(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with (
        FakeServer(Behaviour(first_token_s=0.02, token_interval_s=0.01)) as a,
        FakeServer(Behaviour(first_token_s=0.01, token_interval_s=0.01)) as b,
    ):
        rc = _run(
            [
                "--endpoint",
                f"off={a.url}",
                "--endpoint",
                f"on={b.url}",
                "--prompts",
                str(_prompt_file(tmp_path)),
                "--levels",
                "1",
                "--num-requests",
                "4",
                "--rounds",
                "2",
                "--output-len",
                "4",
                "--duration",
                "600",
                "--time-limit",
                "3600",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    # written per endpoint; issued off 0-1, on 0-1, off 2-3, on 2-3 (start_s goes on across rounds)
    assert [(r["endpoint"], r["index"]) for r in sorted(rows, key=lambda r: (r["endpoint"], r["start_s"]))] == [
        ("off", 0),
        ("off", 1),
        ("off", 2),
        ("off", 3),
        ("on", 0),
        ("on", 1),
        ("on", 2),
        ("on", 3),
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rounds"] == 2
    pair = summary["comparison"]["paired"][0]
    assert pair["n"] == 4 and pair["ttft"] is not None and pair["latency"] is not None
    report = (out / "report.md").read_text()
    assert "alternating in 2 rounds" in report and "Paired by request" in report
    assert f"| 1 | 4 | {pair['ttft']:.3f} |" in report


def test_rounds_beyond_the_requests_are_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = _run(
        [
            "--endpoint",
            "http://127.0.0.1:1",
            "--prompts",
            str(_prompt_file(tmp_path)),
            "--num-requests",
            "2",
            "--rounds",
            "3",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 2 and "rounds must be between 1 and the number of requests (2), got 3" in capsys.readouterr().err


HE = ["--prompts", "humaneval"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--endpoint", "ftp://127.0.0.1:1"], "expected [LABEL=]http(s)://host:port"),
        (["--endpoint", "http://127.0.0.1:1", "--prompts", "mmlu"], "unknown prompt set 'mmlu'"),
        (["--endpoint", "http://127.0.0.1:1", "--endpoint-body", 'C={"a": 1}'], "LABEL one of"),
        (["--endpoint", "http://127.0.0.1:1", "--levels", "1.5", *HE], "whole numbers"),
        (["--endpoint", "a=http://127.0.0.1:1", "--endpoint", "a=http://127.0.0.1:2", *HE], "distinct labels"),
        ([arg for i in range(9) for arg in ("--endpoint", f"http://127.0.0.1:{i + 1}")], "at most 8 times"),
    ],
)
def test_bad_arguments_get_clear_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_argument_values_are_rejected_by_the_parser() -> None:
    for argv in (["--output-len", "9:3"], ["--levels", "one"], ["--extra-body", "[1]"]):
        with pytest.raises(SystemExit):
            _run(["--endpoint", "http://127.0.0.1:1", *argv])


def test_unreachable_endpoint_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fake_openai import free_port

    rc = _run(
        [
            "--endpoint",
            f"http://127.0.0.1:{free_port()}",
            "--prompts",
            "humaneval",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 1 and "pass --model" in capsys.readouterr().err


# `specdecode load` without the dispatcher, which imports every command (torch included).
ENTRY = (
    "import argparse, sys; from specdecode.load import cli; p = argparse.ArgumentParser(); "
    "cli.add_arguments(p); sys.exit(cli.main(p.parse_args()))"
)


def test_ctrl_c_writes_what_finished(tmp_path: Path) -> None:
    behaviour = Behaviour(first_token_s=0.01, token_interval_s=0.01)
    out = tmp_path / "out"
    with FakeServer(behaviour) as server:
        proc = subprocess.Popen(  # -X faulthandler: on a hang, SIGABRT below dumps every thread's stack
            [
                sys.executable,
                "-X",
                "faulthandler",
                "-c",
                ENTRY,
                "--endpoint",
                server.url,
                "--prompts",
                str(_prompt_file(tmp_path)),
                "--levels",
                "1",
                "--num-requests",
                "1000",
                "--output-len",
                "4",
                "--no-progress",
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # the third request has arrived, so two have finished (one at a time); generous limits
        # (a busy machine starts Python slowly) that end as soon as the condition holds
        deadline = time.monotonic() + 300
        while len(behaviour.bodies) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if len(behaviour.bodies) < 3:
            proc.kill()
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"the sweep never sent its third request (exit {proc.returncode}):\n{err[-6000:]}")
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"no exit within 300 s of SIGINT; the process's stacks:\n{err[-6000:]}")
    assert proc.returncode == 130, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    done = len((out / "requests.jsonl").read_text().splitlines())
    assert 2 <= done < 1000 and summary["levels"][0]["completed"] == done
    assert "Interrupted" in (out / "report.md").read_text()


def test_fim_markers_send_one_prompt_in_prefix_suffix_middle_order() -> None:
    """For servers that ignore OpenAI's ``suffix`` (llama-server's /v1/completions): ``--fim-markers`` renders
    a FIM request as one prompt, so every endpoint reads the same tokens; without it the suffix field goes."""
    from specdecode.bench.prompts import Prompt
    from specdecode.load.cli import _fim_markers
    from specdecode.load.client import Target, request_body

    fim = Prompt("f", "fim", "def f(x):\n    ", None, "completion", suffix="\n    return y\n", fim_stop="line")
    markers = _fim_markers("<|fim_prefix|>,<|fim_suffix|>,<|fim_middle|>")
    path, body = request_body(Target("a", "http://x", "m", fim_markers=markers), fim, 16)
    assert path == "/v1/completions" and "suffix" not in body and body["stop"] == ["\n"]
    assert body["prompt"] == "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y\n<|fim_middle|>"
    _, plain = request_body(Target("a", "http://x", "m"), fim, 16)
    assert plain["prompt"] == "def f(x):\n    " and plain["suffix"] == "\n    return y\n"
    with pytest.raises(Exception, match="three comma-separated"):
        _fim_markers("<a>,<b>")
