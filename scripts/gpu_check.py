"""A self-contained check for a CUDA machine: what speculation costs there, measured on the real
Qwen2.5-Coder 1.5B target / 0.5B draft shapes with random weights (speed does not depend on the values;
the GPU machine has no network and no copies of the weights), then the engine's tests on the device.

Measured, in this order (CUDA-synchronised wall clock, warm-up first, medians):

* ``decode``: target-only decode through :class:`~specdecode.engine.Engine` at batch 1 (greedy, EOS
  ignored): end-to-end and decode-only tok/s, and the engine's step time over one bare forward;
* ``verify``: the verification cost v(k) = t(k + 1 tokens) / t(1 token) of one target step through
  ``HFRunner.forward`` plus ``HFRunner.logits`` (what the engine runs per step) at a prefilled
  context, for each k and batch size; the forward alone (no LM head) is kept as ``v_forward``;
* ``draft``: the draft cost ratio c = t_draft(1 token) / t_target(1 token) per batch size (c at batch 1
  is the headline);
* ``spec_step``: one speculative engine step with the 0.5B draft (k = 4, acceptance meaningless on
  random weights) next to the sum of its model forwards, the engine's overhead per step;
* ``projection``: Leviathan's E(α, k) / (k·c + v(k)) with the measured c and v: the best k and its
  predicted speedup per acceptance rate α and batch size (a prediction, not a measurement);
* ``tests``: ``pytest -q tests/test_engine.py tests/test_runner_interface.py`` in a subprocess with
  ``SPECDECODE_TEST_DEVICE`` set to the device (tiny models on the GPU): the summary line and failures.

Everything goes to a JSON file (``--out``), rewritten after each phase so an interrupted run keeps
what it measured. Phases are isolated: an error in one is recorded (``errors``), the next one still
runs, and the exit status is 1. Failing tests are reported (``tests.summary``, ``tests.failures``),
not an exit status: some tests compare with ``model.generate`` on CPU tensors and fail on a GPU.
Time bounds: the v(k) sweep stops starting new batch sizes after ``--max-seconds`` (240, quick 40),
and pytest is killed after ``--tests-timeout`` (200 s).

Usage:
    python scripts/gpu_check.py                       # full: < 8 min on one H200 (tests included)
    python scripts/gpu_check.py --quick --skip-tests  # < 1 min: a few k / batch points, no tests
    python scripts/gpu_check.py --tests-only          # only the tests on the device
    python scripts/gpu_check.py --device cpu --quick --skip-tests --small   # seconds, tiny configs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdecode.bench.analysis import break_even_alpha, predicted_speedup
from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Engine
from specdecode.models.device import DTYPE_CHOICES, device_arg, dtype_arg, dtype_name, resolve_device
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = ("tests/test_engine.py", "tests/test_runner_interface.py")

# config.json of Qwen/Qwen2.5-Coder-1.5B-Instruct and Qwen/Qwen2.5-Coder-0.5B-Instruct (the fields that
# shape the computation; sliding-window attention is off in both)
_QWEN = dict(
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    initializer_range=0.02,
)
TARGET_CONFIG = dict(
    _QWEN,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_window_layers=21,
)
DRAFT_CONFIG = dict(
    _QWEN,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_window_layers=21,
)
# --small: same architecture, tiny sizes (seconds on a CPU; for testing this script)
_SMALL = dict(_QWEN, vocab_size=512, bos_token_id=510, eos_token_id=511, num_key_value_heads=2)
SMALL_TARGET_CONFIG = dict(_SMALL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
SMALL_DRAFT_CONFIG = dict(_SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)

FULL = dict(
    ks=tuple(range(1, 17)),
    batches=(1, 2, 4, 8, 16, 32),
    context=256,
    new_tokens=64,
    decode_repeats=3,
    warmup=2,
    repeats=5,
    spec_k=4,
    spec_steps=16,
)
QUICK = dict(
    ks=(1, 2, 4, 8),
    batches=(1, 8),
    context=128,
    new_tokens=16,
    decode_repeats=2,
    warmup=1,
    repeats=2,
    spec_k=4,
    spec_steps=4,
)
ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)


# -- models ----------------------------------------------------------------------------------------
def build_model(config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> Qwen2ForCausalLM:
    """A Qwen2 causal LM from ``config`` with small random weights, built directly on ``device``."""
    cfg = Qwen2Config(**config)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied embeddings are listed once
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()
    return model


class IdTokenizer:
    """What the engine needs of a tokenizer (``decode``, ``eos_token_id``), without vocabulary files."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# -- timing ----------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# -- phases ----------------------------------------------------------------------------------------
def measure_decode(target, device, plan) -> dict:
    """Target-only decode through the engine at batch 1: median of ``decode_repeats`` after a warm-up."""
    n, ctx = plan["new_tokens"], plan["context"]
    engine = Engine(HFRunner(target), IdTokenizer(), None, 0, EngineSettings(max_batch_size=1, max_context=ctx + n + 1))
    prompt = random_prompts(1, ctx, engine.target.vocab_size, seed=1)[0]
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_new_tokens=min(8, n), ignore_eos=True))  # warm-up
    runs = []
    for _ in range(plan["decode_repeats"]):
        sync(device)
        t0 = time.perf_counter()
        first = None
        tokens = 0
        for ev in engine.stream([prompt], params):
            tokens += len(ev.new_token_ids)
            if first is None:
                first = time.perf_counter()  # prefill + the first step (its .tolist() synchronises)
        sync(device)
        end = time.perf_counter()
        runs.append(
            dict(
                total_s=end - t0,
                first_token_s=first - t0,
                tokens=tokens,
                decode_tok_s=(tokens - 1) / (end - first) if tokens > 1 else None,
            )
        )
    total = statistics.median(r["total_s"] for r in runs)
    decode = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
    decode_tok_s = statistics.median(decode) if decode else None
    runner = engine.target
    slot, ids, pos = (
        torch.zeros(1, dtype=torch.long, device=device),
        torch.zeros(1, 1, dtype=torch.long, device=device),
        torch.full((1, 1), ctx, device=device),
    )
    step = median_time(
        lambda: runner.logits(runner.forward(slot, ids, pos).hidden), device, plan["warmup"], plan["repeats"]
    )
    return dict(
        batch=1,
        context=ctx,
        new_tokens=n,
        repeats=plan["decode_repeats"],
        runs=runs,
        tok_s=n / total,
        decode_tok_s=decode_tok_s,
        first_token_s=statistics.median(r["first_token_s"] for r in runs),
        step_ms=1e3 / decode_tok_s if decode_tok_s else None,
        forward_ms=step * 1e3,
        engine_overhead=(1.0 / decode_tok_s) / step if decode_tok_s else None,
    )


def prefilled_runner(model, batches, context: int, max_q: int) -> HFRunner:
    runner = HFRunner(model, max(batches), context + max_q + 1)
    runner.prefill(list(range(max(batches))), random_prompts(max(batches), context, runner.vocab_size, seed=2))
    return runner


def step_fns(runner: HFRunner, batch: int, q: int, context: int, seed: int):
    """(forward + logits, forward only) of ``q`` new tokens per row after ``context`` cached ones."""
    dev = runner.device
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(batch, device=dev)
    ids = torch.randint(0, runner.vocab_size, (batch, q), generator=gen).to(dev)
    pos = (context + torch.arange(q, device=dev))[None].expand(batch, -1)
    return (lambda: runner.logits(runner.forward(slots, ids, pos).hidden), lambda: runner.forward(slots, ids, pos))


def measure_verify(target, device, plan, deadline: Deadline) -> dict:
    """v(k) per batch size: one step of k + 1 tokens over one of 1 token (both at the same context)."""
    ctx, ks = plan["context"], plan["ks"]
    runner = prefilled_runner(target, plan["batches"], ctx, max(ks) + 1)
    finite = bool(torch.isfinite(step_fns(runner, 1, 2, ctx, 0)[0]()).all())
    rows, complete = {}, True
    for b in plan["batches"]:
        if deadline.left() < 0:
            complete = False
            print(f"  time budget spent: batch sizes from {b} on skipped", flush=True)
            break
        ms, ms_fwd = {}, {}
        for q in (1, *(k + 1 for k in ks)):
            step, fwd = step_fns(runner, b, q, ctx, seed=q)
            ms[q] = median_time(step, device, plan["warmup"], plan["repeats"]) * 1e3
            ms_fwd[q] = median_time(fwd, device, plan["warmup"], plan["repeats"]) * 1e3
        rows[b] = dict(
            step_ms={q: round(t, 4) for q, t in ms.items()},
            forward_ms={q: round(t, 4) for q, t in ms_fwd.items()},
            v={k: ms[k + 1] / ms[1] for k in ks},
            v_forward={k: ms_fwd[k + 1] / ms_fwd[1] for k in ks},
        )
        print(
            f"  batch {b:>2}: 1 token {ms[1]:.2f} ms, " + ", ".join(f"v({k})={rows[b]['v'][k]:.2f}" for k in ks),
            flush=True,
        )
    del runner
    return dict(
        context=ctx,
        ks=list(ks),
        includes="forward + logits of every query (the engine's verify step)",
        finite_logits=finite,
        complete=complete,
        by_batch=rows,
    )


def measure_draft(target, draft, device, plan, batches) -> dict:
    """c per batch size: one 1-token draft step over one 1-token target step, same context."""
    ctx = plan["context"]
    out = {}
    runners = {name: prefilled_runner(m, batches, ctx, 1) for name, m in (("target", target), ("draft", draft))}
    for b in batches:
        t = {
            name: median_time(step_fns(r, b, 1, ctx, seed=7)[0], device, plan["warmup"], plan["repeats"])
            for name, r in runners.items()
        }
        out[b] = dict(draft_ms=t["draft"] * 1e3, target_ms=t["target"] * 1e3, c=t["draft"] / t["target"])
    return dict(context=ctx, by_batch=out, c=out[batches[0]]["c"] if batches else None)


def measure_spec_step(target, draft, device, plan, verify: dict, draft_cost: dict) -> dict:
    """One speculative engine step (k draft steps + a (k+1)-token verify) next to its bare forwards."""
    k, steps, ctx = plan["spec_k"], plan["spec_steps"], plan["context"]
    n = (steps + 2) * (k + 1)  # enough tokens for ``steps`` full steps after the first, whatever the acceptance
    drafter = DraftModelDrafter(HFRunner(draft), target.config.vocab_size)
    engine = Engine(
        HFRunner(target), IdTokenizer(), drafter, k, EngineSettings(max_batch_size=1, max_context=ctx + n + 1)
    )
    prompt = random_prompts(1, ctx, target.config.vocab_size, seed=3)[0]
    engine.generate([prompt], SamplingParams(max_new_tokens=min(8, n), ignore_eos=True))  # warm-up
    sync(device)
    times, drafted, accepted = [], 0, 0
    last = None
    for ev in engine.stream([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True)):
        now = time.perf_counter()  # one event per step at batch 1; .tolist() in the step synchronised
        if last is not None and ev.drafted == k:  # full steps after the first (which includes prefill)
            times.append(now - last)
            drafted += ev.drafted
            accepted += ev.accepted
        last = now
        if len(times) >= steps:
            break
    step_ms = statistics.median(times) * 1e3 if times else None
    one = verify["by_batch"].get(1, {})
    verify_ms = one.get("step_ms", {}).get(k + 1)
    draft_ms = draft_cost["by_batch"].get(1, {}).get("draft_ms")
    predicted = k * draft_ms + verify_ms if verify_ms is not None and draft_ms is not None else None
    return dict(
        k=k,
        batch=1,
        steps_timed=len(times),
        step_ms=step_ms,
        drafted=drafted,
        accepted=accepted,
        forwards_ms=predicted,
        engine_overhead=step_ms / predicted if step_ms and predicted else None,
        note="acceptance is meaningless with random weights; the step time is what matters",
    )


def projection(verify: dict, draft_cost: dict) -> dict:
    """Leviathan's speedup E(α, k) / (k·c + v(k)) with the measured c and v, best k per α and batch."""
    out = {}
    for b, row in verify["by_batch"].items():
        c = draft_cost["by_batch"].get(b, {}).get("c")
        if c is None:
            continue
        per_alpha = {}
        for alpha in ALPHAS:
            k, s = max(((k, predicted_speedup(alpha, k, c, v)) for k, v in row["v"].items()), key=lambda x: x[1])
            per_alpha[alpha] = dict(best_k=k, speedup=s)
        out[b] = dict(
            c=c, by_alpha=per_alpha, break_even_alpha={k: break_even_alpha(k, c, v) for k, v in row["v"].items()}
        )
    return out


def run_tests(device: torch.device, timeout: float) -> dict:
    env = dict(os.environ, SPECDECODE_TEST_DEVICE=str(device))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *TEST_FILES]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc = None
    lines = output.strip().splitlines()
    pattern = re.compile(r"\b(passed|failed|error|errors|no tests ran)\b")
    summary = next((ln.strip("= ") for ln in reversed(lines) if pattern.search(ln)), None)
    return dict(
        command=" ".join(["SPECDECODE_TEST_DEVICE=" + str(device), "pytest -q", *TEST_FILES]),
        returncode=rc,
        timed_out=rc is None,
        timeout_s=timeout,
        seconds=time.perf_counter() - t0,
        summary=summary if rc is not None else f"timed out after {timeout:.0f} s",
        failures=[ln for ln in lines if ln.startswith(("FAILED", "ERROR"))],
        output_tail=output[-4000:],
    )


# -- report ----------------------------------------------------------------------------------------
def environment(device: torch.device, dtype: str, small: bool, quick: bool, commit: str | None = None) -> dict:
    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    env = dict(
        device=str(device),
        dtype=dtype,
        small=small,
        quick=quick,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        commit=commit or git("rev-parse", "HEAD"),
        dirty=None,
        host=platform.node(),
        cpu_threads=torch.get_num_threads(),
    )
    status = git("status", "--porcelain", "--untracked-files=no")
    env["dirty"] = None if status is None else bool(status)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    else:
        env["device_name"] = cpu_name()
    return env


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "cpu")
    except OSError:
        return platform.processor() or "cpu"


def write(path: Path, results: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def print_tables(results: dict) -> None:
    env = results["environment"]
    print(f"\n== {env['device_name']} ({env['device']}), {env['dtype']}, torch {env['torch']}, commit {env['commit']}")
    m = results.get("models")
    if m:
        print(
            f"target {m['target']['params'] / 1e6:.1f} M params, draft {m['draft']['params'] / 1e6:.1f} M params"
            f" ({'small configs' if env['small'] else 'Qwen2.5-Coder 1.5B / 0.5B configs'}, random weights)"
        )
    d = results.get("decode")
    if d:
        print(
            f"\ntarget-only decode, batch 1, {d['new_tokens']} tokens after a {d['context']}-token prompt: "
            f"{d['tok_s']:.1f} tok/s end to end, {d['decode_tok_s'] or float('nan'):.1f} tok/s decode; "
            f"step {d['step_ms'] or float('nan'):.2f} ms vs bare forward {d['forward_ms']:.2f} ms "
            f"(engine overhead {d['engine_overhead'] or float('nan'):.2f}x)"
        )
    v = results.get("verify")
    if v and v["by_batch"]:
        batches = list(v["by_batch"])
        print(f"\nverification cost v(k) = t(k+1 tokens) / t(1 token), forward + logits, context {v['context']}")
        print("| k | " + " | ".join(f"B={b}" for b in batches) + " |")
        print("|---|" + "---|" * len(batches))
        print("| 1-token ms | " + " | ".join(f"{v['by_batch'][b]['step_ms'][1]:.2f}" for b in batches) + " |")
        for k in v["ks"]:
            print(f"| {k} | " + " | ".join(f"{v['by_batch'][b]['v'][k]:.2f}" for b in batches) + " |")
    c = results.get("draft")
    if c:
        print(
            "\ndraft cost c = t_draft(1) / t_target(1): "
            + ", ".join(
                f"B={b}: {r['c']:.2f} ({r['draft_ms']:.2f} / {r['target_ms']:.2f} ms)" for b, r in c["by_batch"].items()
            )
        )
    s = results.get("spec_step")
    if s and s["step_ms"]:
        print(
            f"\nspeculative engine step, k={s['k']}, batch 1: {s['step_ms']:.2f} ms vs its forwards "
            f"{s['forwards_ms']:.2f} ms (engine overhead {s['engine_overhead']:.2f}x)"
        )
    p = results.get("projection")
    if p:
        print("\nprojected speedup E(α,k)/(k·c+v(k)), best k (a prediction from c and v, not a measurement)")
        print("| α | " + " | ".join(f"B={b}" for b in p) + " |")
        print("|---|" + "---|" * len(p))
        for alpha in ALPHAS:
            print(
                f"| {alpha} | "
                + " | ".join(
                    f"{r['by_alpha'][alpha]['speedup']:.2f}x (k={r['by_alpha'][alpha]['best_k']})" for r in p.values()
                )
                + " |"
            )
    t = results.get("tests")
    if t:
        print(f"\ntests on {env['device']}: {t['summary']} ({t['seconds']:.0f} s)")
        for line in t["failures"]:
            print("  " + line)
    for phase, err in results.get("errors", {}).items():
        print(f"\nERROR in {phase}: {err.strip().splitlines()[-1]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", type=device_arg, default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", type=dtype_arg, default="auto", help=f"{', '.join(DTYPE_CHOICES)} (auto: bf16 on CUDA)")
    ap.add_argument("--quick", action="store_true", help="a few k and batch points, fewer tokens and repeats (< 1 min)")
    ap.add_argument(
        "--small", action="store_true", help="tiny configs instead of the Qwen2.5-Coder ones (tests this script)"
    )
    ap.add_argument("--skip-tests", action="store_true", help="do not run the engine's tests on the device")
    ap.add_argument("--tests-only", action="store_true", help="only run the tests")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="measurement budget: the v(k) sweep skips the remaining batch sizes past it (default 240, quick 40)",
    )
    ap.add_argument("--tests-timeout", type=float, default=200.0, help="seconds the pytest run may take (default 200)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument(
        "--commit", help="the commit to record where the copy has no git history (default: git rev-parse HEAD)"
    )
    args = ap.parse_args(argv)

    start = time.monotonic()
    deadline = Deadline(args.max_seconds or (40 if args.quick else 240))
    device = resolve_device(args.device)
    dtype = dtype_name(args.dtype, device)
    plan = dict(QUICK if args.quick else FULL)
    results: dict = dict(
        environment=environment(device, dtype, args.small, args.quick, args.commit),
        plan={k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()},
        errors={},
    )
    print(
        f"gpu_check: {results['environment']['device_name']} ({device}), {dtype}, "
        f"{'quick' if args.quick else 'full'}{', small configs' if args.small else ''}",
        flush=True,
    )

    def phase(name, fn):
        t0 = time.monotonic()
        print(f"[{time.monotonic() - start:6.1f} s] {name} ...", flush=True)
        try:
            results[name] = fn()
        except Exception:  # recorded, and the next phase still runs
            results["errors"][name] = traceback.format_exc()
            print(results["errors"][name], file=sys.stderr, flush=True)
        results.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 2)
        write(args.out, results)
        return results.get(name)

    if not args.tests_only:
        torch_dtype = getattr(torch, dtype)
        target_cfg, draft_cfg = (
            (SMALL_TARGET_CONFIG, SMALL_DRAFT_CONFIG) if args.small else (TARGET_CONFIG, DRAFT_CONFIG)
        )
        models = {}

        def build():
            models["target"] = build_model(target_cfg, device, torch_dtype, seed=0)
            models["draft"] = build_model(draft_cfg, device, torch_dtype, seed=1)
            return {
                name: dict(params=param_count(m), config=cfg)
                for (name, m), cfg in zip(models.items(), (target_cfg, draft_cfg))
            }

        if phase("models", build):
            target, draft = models["target"], models["draft"]
            phase("decode", lambda: measure_decode(target, device, plan))
            verify = phase("verify", lambda: measure_verify(target, device, plan, deadline))
            batches = list(verify["by_batch"]) if verify else [1]
            draft_cost = phase("draft", lambda: measure_draft(target, draft, device, plan, batches))
            if verify and draft_cost:
                phase("spec_step", lambda: measure_spec_step(target, draft, device, plan, verify, draft_cost))
                phase("projection", lambda: projection(verify, draft_cost))
            del target, draft
            models.clear()
            if device.type == "cuda":
                results["environment"]["max_memory_allocated_gib"] = round(
                    torch.cuda.max_memory_allocated(device) / 2**30, 2
                )
                torch.cuda.empty_cache()
    if not args.skip_tests:
        phase("tests", lambda: run_tests(device, args.tests_timeout))
    results.setdefault("seconds", {})["total"] = round(time.monotonic() - start, 1)
    write(args.out, results)
    print_tables(results)
    print(f"\nwrote {args.out} ({results['seconds']['total']:.0f} s)")
    return 1 if results["errors"] else 0  # failing tests are reported, not an error of this script


if __name__ == "__main__":
    sys.exit(main())
