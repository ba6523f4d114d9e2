"""`specdecode load` against our real server (tiny model, loopback): the two halves fit together."""

from specdecode.bench.prompts import Prompt
from specdecode.load.client import Target
from specdecode.load.runner import LoadConfig, run_sweep
from specdecode.load.stats import summarize
from test_server_harness import KEY, engine, one_torch_thread, serve  # noqa: F401  (fixture)

PROMPTS = [
    Prompt(id=f"p{i}", category="tiny", text=text, messages=None, kind="completion", max_new_tokens=None)
    for i, text in enumerate(["abc", "hello", "xyzxyz", "aaaa", "Q1w2"])
]


def test_sweep_speculation_on_vs_off_against_our_server():
    with serve(engine(k=3, slots=4)) as served:
        config = LoadConfig(
            targets=[
                Target("off", served.url, extra_body={"speculation": False, "ignore_eos": True, "temperature": 0}),
                Target("on", served.url, extra_body={"ignore_eos": True, "temperature": 0}),
            ],
            prompts=PROMPTS,
            levels=[1, 4],
            num_requests=8,
            output_len=(12, 12),
            duration_s=600,
            time_limit_s=3600,  # guards only: every level must finish all 8 requests
            api_key=KEY,
        )
        result = run_sweep(config)
        served.wait_idle()
    assert not result.interrupted and not result.skipped
    assert [(r.label, r.level) for r in result.levels] == [("off", 1), ("on", 1), ("off", 4), ("on", 4)]
    for run in result.levels:
        assert len(run.records) == 8 and all(r.error is None for r in run.records)
        assert all(r.output_tokens == 12 and r.token_source == "usage" for r in run.records)
        assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s for r in run.records)
        summary = summarize(run)
        assert summary.completed == 8
        spec = [r.speculation for r in run.records]
        if run.label == "off":  # opted out: nothing drafted
            assert all(s["drafted"] == 0 and s["tokens_per_step"] == 1.0 for s in spec)
        else:
            assert sum(s["drafted"] for s in spec) > 0 and sum(s["accepted"] for s in spec) > 0
