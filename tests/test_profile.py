"""`specdecode profile`: the arithmetic of v(n), c, break-even and the ceiling checked exactly against known
costs (a fake clock that runners advance by what each forward is declared to cost), the cache's round trip
and invalidation, and the command's output. No assertion reads the wall clock."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch

from specdecode.models.backends import toy
from specdecode.profile import cache, cached, decode_speeds, store
from specdecode.profile import measure as M
from specdecode.profile.result import (
    Machine,
    ModelCost,
    Profile,
    break_even,
    break_even_alpha,
    ceiling,
    limit,
    tokens_per_step,
)
from specdecode.profile.run import profile_runners


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costed:
    """A runner whose forwards advance ``clock`` by declared costs (seconds): ``base + layer * n`` for the
    layers of n tokens and ``output * n`` more when every row's logits are asked for (a forward; a prefill
    asks for none); ``outlier`` seconds are added to the ``outlier_at``-th forward of ``outlier_n`` tokens.
    Everything else is the wrapped runner's own (it computes for real)."""

    def __init__(self, runner, clock, base, layer, output, outlier=0.0, outlier_n=0, outlier_at=-1):
        self.runner, self.clock = runner, clock
        self.base, self.layer, self.output = base, layer, output
        self.outlier, self.outlier_n, self.outlier_at = outlier, outlier_n, outlier_at
        self.forwards: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def prefill(self, slots, prompts, layers=(), starts=None):
        out = self.runner.prefill(slots, prompts, layers, starts)
        if starts is not None:  # a timed layers-only pass (the context's own prefill is not timed)
            self.clock.now += self.base + self.layer * len(prompts[0])
        return out

    def forward(self, slots, ids, positions, **kw):
        out = self.runner.forward(slots, ids, positions, **kw)
        n = ids.shape[1]
        self.clock.now += self.base + (self.layer + self.output) * n
        seen = self.forwards[n] = self.forwards.get(n, 0) + 1
        if n == self.outlier_n and seen == self.outlier_at:
            self.clock.now += self.outlier
        return out


def toy_runner(seed: int, noise: float = 0.0):
    return toy.ToyModel("toy", None, toy.CONTEXT, toy.VOCAB, seed=seed, noise=noise).runner()


def round_cost(base, layer, output, widths):
    """Seconds of one round of a probe: each width's layers-only pass and its forward."""
    return sum(2 * base + (2 * layer + output) * n for n in widths)


MACHINE = Machine("Test CPU", ("avx2", "fma", "sse4_2"))


def measured(target_runner, draft_runner, clock, rounds=5):
    costs = (0.010, 0.002, 0.001), (0.004, 0.0005, 0.0005)  # (base, layer, output): target, draft
    one = round_cost(*costs[0], M.WIDTHS) + round_cost(*costs[1], M.DRAFT_WIDTHS)
    target = Costed(target_runner, clock, *costs[0], outlier=100.0, outlier_n=3, outlier_at=3)
    draft = Costed(draft_runner, clock, *costs[1])
    profile = profile_runners(
        "toy", 1, ("toy:1", target), [("toy:1:0.2", draft)], (rounds + 1) * one + one / 2, clock, machine=MACHINE
    )
    return profile, costs


def check_arithmetic(profile: Profile, costs) -> None:
    (a, b, o), (da, db, do) = costs
    t1 = a + b + o
    assert profile.target.repeats == 5  # the budget held the warm-up and five rounds
    for n in M.WIDTHS:
        assert profile.target.step_s[n] == pytest.approx(a + (b + o) * n, rel=1e-9)  # the outlier is not the median
        assert profile.v[n] == pytest.approx((a + (b + o) * n) / t1, rel=1e-9)
        assert profile.target.output_share(n) == pytest.approx(o * n / (a + (b + o) * n), rel=1e-9)
    c = (da + db + do) / t1
    assert profile.c("toy:1:0.2") == pytest.approx(c, rel=1e-9)
    v = profile.v
    for k in range(1, 9):
        assert break_even(v, k, c) == pytest.approx((a + (b + o) * (k + 1)) / t1 + k * c, rel=1e-9)
        assert ceiling(v, k, c) == pytest.approx((k + 1) / break_even(v, k, c), rel=1e-12)
        alpha = break_even_alpha(v, k, c)
        if break_even(v, k, c) < k + 1:
            assert tokens_per_step(alpha, k) == pytest.approx(break_even(v, k, c), rel=1e-9)
        else:
            assert alpha is None
    assert limit(v) == pytest.approx(t1 / (b + o), rel=1e-9)  # v is exactly linear here: time(1) / slope
    assert profile.verify_grid() == {1: profile.target.step_s}


def test_the_arithmetic_on_the_toy_backend_against_known_costs():
    clock = FakeClock()
    profile, costs = measured(toy_runner(1), toy_runner(1, 0.2), clock)
    check_arithmetic(profile, costs)
    one = round_cost(*costs[0], M.WIDTHS) + round_cost(*costs[1], M.DRAFT_WIDTHS)
    assert profile.measured_s == pytest.approx(5 * one + 100.0)  # the outlier was timed, and left out of the median
    summary = profile.summary()
    assert set(summary["drafters"]) == {"lookup (c = 0)", "draft toy:1:0.2"}
    assert summary["drafters"]["lookup (c = 0)"]["break_even_tokens"][4] == pytest.approx(profile.v[5])


def test_the_arithmetic_on_a_tiny_torch_model():
    """The same exact numbers through the torch backend's runner (prefill with a start, forward, logits,
    truncate), and the context it measured after is intact: the next token's logits equal a fresh run's."""
    from tiny import make_model, make_tokenizer

    from specdecode.models.backends.pytorch import TorchModel

    target = TorchModel.wrap(make_model(64, seed=0), make_tokenizer(64))
    draft = TorchModel.wrap(make_model(64, seed=1, layers=1), make_tokenizer(64))
    runner = target.runner()
    profile, costs = measured(runner, draft.runner(draft=True), FakeClock())
    check_arithmetic(profile, costs)
    tokens = [(17 + 7919 * i) % 63 for i in range(M.CONTEXT + 1)]
    with torch.inference_mode():
        after = runner.logits(
            runner.forward(torch.tensor([0]), torch.tensor([tokens[-1:]]), torch.tensor([[256]])).hidden
        )
        fresh = target.module(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(after[0, -1], fresh, rtol=1e-4, atol=1e-4)


def test_the_budget_decides_the_rounds():
    assert M.rounds_for(10.0, 1.0) == 10
    assert M.rounds_for(1.0, 1.0) == M.MIN_ROUNDS  # a slow machine still gets a median of several
    assert M.rounds_for(1e6, 1.0) == M.MAX_ROUNDS
    assert M.rounds_for(1.0, 0.0) == M.MAX_ROUNDS


def costs_of(step, c=None) -> Profile:
    """A profile whose target's forward of n tokens costs ``step(n)`` seconds, with a draft of step ``c``."""
    t = ModelCost("t", "t", "", {n: step(n) for n in range(1, 10)})
    drafts = {} if c is None else {"d": ModelCost("d", "d", "", {1: c * step(1)})}
    return Profile("toy", 2, MACHINE, 256, t, drafts)


def test_the_verdict_names_the_cost_in_the_way():
    # a forward of n tokens costs n steps: verify itself stands in the way, whatever the drafter
    linear = costs_of(lambda n: 0.02 * n, c=0.1)
    assert all("verify stands in the way" in linear.obstacle(name, c) for name, c in linear.costs().items())
    # issue 37's shape (v(5) ~ 3.6): a lookup pays, the 0.5B draft (c ~ 0.5) cannot
    profile = costs_of(lambda n: 0.025 + 0.0163 * (n - 1) if n > 1 else 0.025, c=0.52)
    v = profile.v
    lookup, draft = (profile.obstacle(name, c) for name, c in profile.costs().items())
    assert lookup.startswith("lookup (c = 0): pays at best at k = 8") and "break-even at acceptance" in lookup
    most = max((k + 1 - v[k + 1]) / k for k in range(1, 9))
    assert "its cost stands in the way: c = 0.52" in draft and f"no drafter with c >= {most:.2f}" in draft
    assert 0 < most < 0.52
    # a cheap verify: the draft pays, and says from which acceptance
    cheap = costs_of(lambda n: 0.02 + 0.002 * n, c=0.2)
    line = cheap.obstacle("draft d", cheap.c("d"))
    assert line.startswith("draft d: pays at best at k =") and "with every draft accepted" in line


def test_ceilings_are_also_given_against_the_fastest_backend():
    """A backend whose own target-only decoding is slow can show a high ceiling over itself: against the
    fastest one-token decode among the backends it is scaled by the ratio of their speeds."""
    from specdecode.profile.report import against_the_bar, bar_text

    fast = costs_of(lambda n: 0.02 * (1 + 0.5 * (n - 1)), c=0.5)
    slow = replace(costs_of(lambda n: 0.1 * (1 + 0.01 * (n - 1)), c=0.3), backend="torch")
    name, rows = against_the_bar([fast, slow])
    assert name == "toy"
    ceilings = {(backend, drafter): (k, x) for backend, drafter, k, x in rows}
    k, x = ceilings[("torch", "draft d")]
    assert x == pytest.approx(ceiling(slow.v, k, 0.3) * 0.02 / 0.1)
    assert ceilings[("toy", "lookup (c = 0)")][1] == pytest.approx(max(ceiling(fast.v, k) for k in range(1, 9)))
    assert "the bar: toy's one-token decode, 50.0 tok/s" in bar_text([fast, slow])


def test_break_even_acceptance_edges():
    v = {n: 1.0 for n in range(1, 10)}  # a free verify: any acceptance pays
    assert break_even_alpha(v, 3) == 0.0
    v = {n: float(n) for n in range(1, 10)}
    assert break_even_alpha(v, 3) is None  # k + 1 tokens at most, costing k + 1 steps
    assert tokens_per_step(1.0, 4) == 5 and tokens_per_step(0.0, 4) == 1
    assert math.isinf(limit({n: 1.0 for n in range(1, 10)}))


# -- the cache -------------------------------------------------------------------------------------


@pytest.fixture
def model_dirs(tmp_path, monkeypatch):
    """A target and a draft as transformers directories (fingerprinted by their files), a private cache."""
    from tiny import make_model, make_tokenizer

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    dirs = []
    for name, seed in (("target", 0), ("draft", 1)):
        make_model(32, seed=seed, layers=1).save_pretrained(tmp_path / name)
        make_tokenizer(32).save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))
    return dirs


def stored_profile(target: str, draft: str, threads: int = 2) -> Profile:
    profile = costs_of(lambda n: 0.03 + 0.01 * n, c=0.4)
    d = replace(profile.drafts["d"], spec=draft, fingerprint=cache.fingerprint(draft))
    t = replace(profile.target, spec=target, fingerprint=cache.fingerprint(target))
    return replace(
        profile,
        threads=threads,
        machine=cache.this_machine(),
        target=t,
        drafts={draft: d},
        key=cache.key("torch", target, threads),
    )


def touch(directory: str) -> None:
    """Change a model's files as a new download would (size and time)."""
    with open(os.path.join(directory, "config.json"), "a") as f:
        f.write("\n")


def test_the_cache_round_trip_and_what_invalidates_it(model_dirs, monkeypatch):
    target, draft = model_dirs
    assert cached(target, "torch", 2) is None
    profile = stored_profile(target, draft)
    path = store(profile)
    assert path.parent.name == "profile" and path.is_file()
    assert cached(target, "torch", 2) == profile
    assert cached(target, "torch", 1) is None  # other threads
    assert cached(target, "llamacpp", 2) is None  # another backend
    assert cached(target, "torch", 2, context=512) is None  # another context
    speeds = decode_speeds(2)  # what --backend auto reads: tok/s per (backend, target)
    assert speeds("torch", target) == pytest.approx(1 / 0.04) and speeds("llamacpp", target) is None
    assert decode_speeds(1)("torch", target) is None
    touch(draft)  # the draft's files changed: its c goes, the target's profile stays
    assert cached(target, "torch", 2) == replace(profile, drafts={})
    touch(target)  # the target's files changed: nothing fits
    assert cached(target, "torch", 2) is None
    store(stored_profile(target, draft))
    assert cached(target, "torch", 2) is not None
    other = Machine("Other CPU", tuple(sorted(cache.this_machine().flags + ("amx_tile",))))
    monkeypatch.setattr(cache, "this_machine", lambda: other)  # another CPU (or the same model with other flags)
    assert cached(target, "torch", 2) is None


def test_an_unreadable_or_foreign_cache_file_is_no_profile(model_dirs):
    target, draft = model_dirs
    path = store(stored_profile(target, draft))
    path.write_text("{not json")
    assert cached(target, "torch", 2) is None
    data = stored_profile(target, draft).to_json() | {"format": 0}
    path.write_text(json.dumps(data))
    assert cached(target, "torch", 2) is None


# -- the command -----------------------------------------------------------------------------------


def run(capsys, *argv):
    from specdecode.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_prints_caches_and_writes_json_and_png(capsys, tmp_path, monkeypatch):
    from specdecode.models import backends

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    # found through the registry, not by name: a backend registered at run time is profiled too
    monkeypatch.setitem(backends.BACKENDS, "toy2", "specdecode.models.backends.toy")
    out_dir = tmp_path / "out"
    argv = ["profile", "--target", "toy:1", "--draft", "toy:1:0.2", "--threads", "1", "--budget", "0.2"]
    code, out, err = run(capsys, *argv, "--out", str(out_dir))
    assert code == 0, err
    assert out.startswith("machine: ") and "flags: " in out and cache.this_machine().simd() in out
    assert "## toy: toy:1" in out and "## toy2: toy:1" in out
    assert "| v(n) = time(n) / time(1) | 1.00 |" in out
    assert "draft toy:1:0.2: " in out and "lookup (c = 0): " in out
    assert "the bar: " in out and "- toy2, draft toy:1:0.2: " in out
    data = json.loads((out_dir / "profile.json").read_text())
    assert [p["backend"] for p in data["profiles"]] == ["toy", "toy2"]
    first = data["profiles"][0]
    assert set(first["summary"]["drafters"]) == {"lookup (c = 0)", "draft toy:1:0.2"}
    assert first["summary"]["drafters"]["draft toy:1:0.2"]["c"] > 0
    assert len(first["target"]["step_s"]) == 9 and first["machine"]["flags"]
    assert (out_dir / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## toy: toy:1" in (out_dir / "report.md").read_text()
    found = cached("toy:1", "toy", 1)
    assert found is not None and set(found.drafts) == {"toy:1:0.2"}
    assert found.v == Profile.from_json(first).v

    code, again, err = run(capsys, *argv, "--backend", "toy", "--out", str(out_dir))
    assert code == 0, err
    assert "toy: cached profile from" in again and "profiling" not in err
    assert f"{found.v[5]:.2f}" in again
    code, again, err = run(capsys, *argv, "--backend", "toy", "--remeasure", "--out", str(out_dir))
    assert code == 0 and "toy: cached profile" not in again and "toy: cached in" in again


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--backend", "llamacpp", "--target", "toy:1"], "--backend llamacpp cannot profile toy:1"),
        (["--target", "toy:1", "--budget", "0"], "--budget must be > 0"),
        (["--target", "nosuch-model-xyz"], "no installed backend opens"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, argv, says):
    code, _, err = run(capsys, "profile", "--threads", "1", "--out", str(tmp_path), *argv)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_the_library_core_never_imports_the_tool():
    """The profile is a tool: a fresh interpreter that imports the engine, the builders and every backend
    has not imported it."""
    import subprocess
    import sys

    code = (
        "import sys, specdecode.engine, specdecode.build, specdecode.models.backends as b\n"
        "[b.get(n) for n in b.names()]\n"
        "print(any(m.startswith('specdecode.profile') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_commands_hand_auto_the_cached_speeds_for_their_threads(monkeypatch):
    """--backend auto reads the cached profile of the thread count the command runs with; a backend asked for
    by name, or no thread count, reads nothing."""
    from specdecode.config import EngineConfig
    from specdecode.profile import cache

    asked = []
    monkeypatch.setattr(cache, "decode_speeds", lambda threads: asked.append(threads) or (lambda b, t: 1.0))
    assert cache.measured_speeds(EngineConfig("toy:1", threads=3))("llamacpp", "toy:1") == 1.0 and asked == [3]
    assert cache.measured_speeds(EngineConfig("toy:1", threads=3, backend="torch")) is None
    assert cache.measured_speeds(EngineConfig("toy:1")) is None and asked == [3]
