"""docs/bench/peers/summarize.py on a fabricated run folder: the bar is the fastest ordinary decoder that
completed its level without errors, never a speculative endpoint, and every endpoint's ratio is to it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _summarize():
    spec = importlib.util.spec_from_file_location("peers_summarize", ROOT / "docs/bench/peers/summarize.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(label, level, tok_s, ttft_p50, errors=None, completed=4):
    dist = {"p50": ttft_p50, "p90": ttft_p50, "p99": ttft_p50 * 2, "mean": ttft_p50}
    return {
        "label": label,
        "level": level,
        "completed": completed,
        "errors": errors or {},
        "output_throughput": tok_s,
        "ttft": dist,
        "latency": {"p50": 1.0, "p90": 1.5, "p99": 2.0, "mean": 1.1},
        "cached_share": 0.5,
        "speculation": None,
    }


def _write(run_dir: Path, folder: str, prompt_set: str, rows: list[dict]) -> None:
    (run_dir / folder).mkdir(parents=True)
    summary = {"config": {"prompt_set": prompt_set}, "levels": rows}
    (run_dir / folder / "summary.json").write_text(json.dumps(summary))


def test_bar_is_the_fastest_ordinary_decoder_without_errors():
    s = _summarize()
    rows = [
        _row("llama-server", 1, 10.0, 0.2),
        _row("llamacpp-target", 1, 12.0, 0.3),
        _row("llamacpp-auto", 1, 30.0, 0.1),  # faster, but speculative: never the bar
        _row("ik-target", 1, 20.0, 0.1, errors={"http_400": 4}, completed=0),
    ]
    bar = s.pick_bar(rows)
    assert bar["label"] == "llamacpp-target"
    assert s.pick_bar([rows[2]]) is None
    assert s.pick_bar(rows, ordinary=("llama-server",))["label"] == "llama-server"


def test_table_gives_each_endpoint_its_ratio_to_the_bar(tmp_path):
    s = _summarize()
    _write(
        tmp_path,
        "humaneval-test",
        "humaneval:test",
        [
            _row("llama-server", 1, 10.0, 0.2),
            _row("llamacpp-auto", 1, 25.0, 0.1),
            _row("llama-server", 4, 8.0, 0.4, errors={"http_400": 1}),
            _row("llamacpp-auto", 4, 16.0, 0.2),
        ],
    )
    (tmp_path / "commit.txt").write_text("abc123\n")
    text = s.render(tmp_path)
    assert "abc123" in text and "## humaneval:test" in text
    lines = text.splitlines()
    bar_row = next(line for line in lines if line.startswith("| 1 | **llama-server** (bar)"))
    auto_row = next(line for line in lines if line.startswith("| 1 | llamacpp-auto"))
    assert "| 10.00 | 1.00 | 200 | 1.00 |" in bar_row
    assert "| 25.00 | 2.50 | 100 | 0.50 |" in auto_row
    # at level 4 the only ordinary decoder failed requests: no bar, no ratios
    assert any(line.startswith("| 4 | no bar") for line in lines)
    assert "| 16.00 | - | 200 | - |" in next(line for line in lines if line.startswith("| 4 | llamacpp-auto"))


def _requests(run_dir: Path, folder: str, tokens: dict[str, list[int]]) -> None:
    with (run_dir / folder / "requests.jsonl").open("w") as fh:
        for label, counts in tokens.items():
            for index, n in enumerate(counts):
                row = {"endpoint": label, "level": 1, "index": index, "prompt_tokens": n, "error": None}
                fh.write(json.dumps(row) + "\n")


def test_an_endpoint_that_read_other_prompts_is_neither_bar_nor_compared(tmp_path):
    """llama-server drops a FIM request's suffix: its prompts are a third as long, and it is fast for it."""
    s = _summarize()
    rows = [
        _row("llama-server", 1, 20.0, 0.1),
        _row("llamacpp-target", 1, 5.0, 2.0),
        _row("llamacpp-auto", 1, 6.0, 1.5),
    ]
    _write(tmp_path, "editor", "editor_replay:test", rows)
    _requests(
        tmp_path, "editor", {"llama-server": [470, 471], "llamacpp-target": [1522, 1523], "llamacpp-auto": [1522, 1524]}
    )
    text = s.render(tmp_path)
    lines = text.splitlines()
    server_row = next(line for line in lines if line.startswith("| 1 | llama-server "))
    assert "470 (other prompt) | 20.00 | - | 100 | - |" in server_row
    assert any(line.startswith("| 1 | **llamacpp-target** (bar) | 4 | 0 | 1522 | 5.00 | 1.00 |") for line in lines)
    assert "| 1523 | 6.00 | 1.20 | 1500 | 0.75 |" in next(
        line for line in lines if line.startswith("| 1 | llamacpp-auto")
    )
    # small differences (a chat template, a session's own answers) stay comparable
    rows = [_row("llama-server", 1, 20.0, 0.1), _row("llamacpp-target", 1, 5.0, 2.0)]
    s.mark_prompts(rows, {("llama-server", 1): {0: 100}, ("llamacpp-target", 1): {0: 104}})
    assert not any(r["other_prompt"] for r in rows)
