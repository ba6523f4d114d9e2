"""Grammar engines for structured outputs: mask time per token on the real Qwen2.5 vocabulary (issue 40).

Compares llguidance and xgrammar on what speculation asks of a grammar engine:

* compile: from a spec to a matcher ready for its first mask (a fresh compiler, no cache);
* mask per token: the next-token bitmask after each token of a realistic output (the output's own
  tokenization by the real tokenizer), first request (cold caches) and later requests (warm);
* rollback of N tokens after consuming them;
* a drafted window: the masks at the k + 1 positions a k-token chain verifies (mask, consume a drafted
  token, mask, ...), then one rollback of k, at every position of the output (llguidance also through
  its one-call ``fill_next_token_bitmask_par_with_draft_tokens``);
* applying a window's bitmasks to logits ``[k + 1, 151936]``.

Workloads: a JSON schema (strings, numbers, an enum, an array, a nested object), ``json_object``
(``{"type": "object"}``) on the same output, and a regex. Both engines are driven through the same
HF tokenizer with the logits' width (151,936).

    python docs/bench/structured/mask_time.py --out docs/bench/structured/avx2-mask-time

xgrammar pulls triton (285 MB) on x86-64 Linux; to measure it without changing the environment install
it beside: ``pip install --target /tmp/xgenv --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2``
and pass ``--xgrammar-path /tmp/xgenv``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

VOCAB = 151_936  # Qwen2.5's lm_head rows: the width of the logits the masks apply to

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "height_m": {"type": "number"},
        "role": {"type": "string", "enum": ["engineer", "manager", "designer", "scientist"]},
        "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "height_m", "role", "skills", "address", "active"],
    "additionalProperties": False,
}

OUTPUT = {
    "name": "Ada Lovelace",
    "age": 36,
    "height_m": 1.65,
    "role": "scientist",
    "skills": ["mathematics", "analytical engines", "poetry of science", "translation"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "active": True,
}

REGEX = r"(\d{4}-\d{2}-\d{2} [A-Z][a-z]+ [a-z]+@[a-z]+\.(com|org|net)\n){1,8}"
REGEX_OUTPUT = (
    "2024-03-14 Alice alice@example.com\n2023-11-02 Robert bob@mail.org\n2025-01-30 Carol carol@research.net\n"
)


def default_tokenizer_dir() -> str:
    found = sorted(glob.glob(os.path.expanduser("~/.cache/specdecode/converted/qwen2.5*-tokenizer")))
    if not found:
        raise SystemExit("no Qwen2.5 tokenizer under ~/.cache/specdecode/converted (pass --tokenizer DIR)")
    return found[-1]


def summary(us: list[float]) -> dict:
    us = sorted(us)
    return {
        "n": len(us),
        "mean_us": round(statistics.fmean(us), 1),
        "p50_us": round(us[len(us) // 2], 1),
        "p90_us": round(us[int(len(us) * 0.9)], 1),
        "max_us": round(us[-1], 1),
    }


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.version = llguidance.__version__
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=VOCAB)
        self.tokenizer_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, kind: str, text):
        llg = self.llg
        grammar = (
            llg.LLMatcher.grammar_from_regex(text) if kind == "regex" else llg.LLMatcher.grammar_from_json_schema(text)
        )
        m = llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, n: int):
        return self.lt.allocate_token_bitmask(n, VOCAB)

    def fill(self, m, bitmask, row: int):
        self.lt.fill_next_token_bitmask(m, bitmask, row)

    def consume(self, m, token: int):
        assert m.consume_token(token), m.get_error()

    def rollback(self, m, n: int):
        m.rollback(n)

    def window_one_call(self, m, drafts, bitmask):
        self.lt.fill_next_token_bitmask_par_with_draft_tokens(self.executor, [(m, 0, list(drafts))], bitmask)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tok):
        import xgrammar as xgr
        from importlib.metadata import version

        self.xgr = xgr
        self.version = version("xgrammar")
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=VOCAB)
        self.tokenizer_s = time.perf_counter() - t

    def compile(self, kind: str, text):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_json_schema(json.dumps(text), any_whitespace=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, VOCAB)

    def fill(self, m, bitmask, row: int):
        m.fill_next_token_bitmask(bitmask, row)

    def consume(self, m, token: int):
        assert m.accept_token(token)

    def rollback(self, m, n: int):
        m.rollback(n)

    window_one_call = None


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def mask_walk(engine, compiled, ids: list[int]) -> list[float]:
    """µs of the mask before each token and after the last one, along the output."""
    m, bm, out = engine.matcher(compiled), engine.bitmask(1), []
    for tok in ids:
        out.append(timed(lambda: engine.fill(m, bm, 0)))
        engine.consume(m, tok)
    out.append(timed(lambda: engine.fill(m, bm, 0)))
    return out


def rollback_cost(engine, compiled, ids: list[int], n: int) -> list[float]:
    m, out = engine.matcher(compiled), []
    for i in range(0, len(ids) - n, n):
        for tok in ids[i : i + n]:
            engine.consume(m, tok)
        out.append(timed(lambda: engine.rollback(m, n)))
        for tok in ids[i : i + n]:
            engine.consume(m, tok)
    return out


def window_cost(engine, compiled, ids: list[int], k: int) -> tuple[list[float], list[float]]:
    """µs per verified window (k + 1 masks along k drafted tokens + one rollback), the Python loop and,
    where the engine has one, its one-call form. The drafts are the output's next k tokens."""
    m, bm = engine.matcher(compiled), engine.bitmask(k + 1)
    loop, one = [], []

    def by_loop(drafts):
        engine.fill(m, bm, 0)
        for j, tok in enumerate(drafts):
            engine.consume(m, tok)
            engine.fill(m, bm, j + 1)
        engine.rollback(m, len(drafts))

    for i in range(len(ids) - k):
        drafts = ids[i : i + k]
        loop.append(timed(lambda: by_loop(drafts)))
        if engine.window_one_call is not None:
            one.append(timed(lambda: engine.window_one_call(m, drafts, bm)))
        engine.consume(m, ids[i])
    return loop, one


def apply_costs(hf_tok, k: int = 8) -> dict:
    """µs to mask logits [k + 1, VOCAB] along a k-token drafted chain: specdecode's GrammarProcessor.apply
    (masks + unpack + copy with -inf) on the JSON-schema output, its masks alone, and the bare unpack
    and xgrammar's CPU kernel on the same bitmasks."""
    from specdecode.grammar import GrammarCompiler, GrammarSpec, bitmask_to_bool

    out = {}
    ids = hf_tok.encode(json.dumps(OUTPUT))
    proc = GrammarCompiler(hf_tok).processor(GrammarSpec.json_schema(SCHEMA))
    logits = torch.randn(k + 1, VOCAB)
    windows = [[tuple(ids[i : i + j]) for j in range(k + 1)] for i in range(len(ids) - k)]
    apply_us, masks_us, unpack_us, bits_seen = [], [], [], []
    for i, prefixes in enumerate(windows):
        apply_us.append(timed(lambda: proc.apply(logits, prefixes)))
        masks_us.append(timed(lambda: proc.masks(prefixes)))
        bits = proc.masks(prefixes)[0]
        unpack_us.append(timed(lambda: bitmask_to_bool(bits, VOCAB)))
        bits_seen.append(bits)
        proc.commit([ids[i]])
    out[f"GrammarProcessor.apply, k={k}"] = summary(apply_us)
    out[f"GrammarProcessor.masks (bitmasks only), k={k}"] = summary(masks_us)
    out["bitmask_to_bool"] = summary(unpack_us)
    try:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits.clone(), bits_seen[0], backend="cpu")
        out["xgrammar.apply_token_bitmask_inplace(cpu) + clone"] = summary(
            [timed(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), bits, backend="cpu")) for bits in bits_seen]
        )
    except ImportError:
        pass
    out["logits.clone() alone"] = summary([timed(lambda: logits.clone()) for _ in bits_seen])
    return out


def cpu_info() -> dict:
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx", "fma", "sse4", "amx", "f16c", "bmi"))]
    return {
        "model": model,
        "cores": os.cpu_count(),
        "simd_flags": simd,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_engine(engine, hf_tok, repeats: int) -> dict:
    ids_json = hf_tok.encode(json.dumps(OUTPUT))
    ids_regex = hf_tok.encode(REGEX_OUTPUT)
    workloads = {
        "json_schema": ("json", SCHEMA, ids_json),
        "json_object": ("json", {"type": "object"}, ids_json),
        "regex": ("regex", REGEX, ids_regex),
    }
    res = {"version": engine.version, "tokenizer_s": round(engine.tokenizer_s, 3), "workloads": {}}
    for name, (kind, text, ids) in workloads.items():
        compile_ms = []
        for _ in range(3):
            t = time.perf_counter()
            compiled = engine.compile(kind, text)
            engine.fill(engine.matcher(compiled), engine.bitmask(1), 0)  # llguidance builds lazily
            compile_ms.append((time.perf_counter() - t) * 1e3)
        compiled = engine.compile(kind, text)
        cold = mask_walk(engine, compiled, ids)
        passes = [mask_walk(engine, compiled, ids) for _ in range(repeats)]
        warm = [us for walk in passes for us in walk]
        best = [min(column) for column in zip(*passes)]  # each position's best pass: preemption removed
        w = {
            "tokens": len(ids),
            "compile_first_mask_ms": [round(x, 1) for x in compile_ms],
            "mask_cold": summary(cold),
            "mask_warm": summary(warm),
            "mask_best_of_passes": summary(best),
        }
        for n in (1, 4, 8):
            w[f"rollback_{n}"] = summary(rollback_cost(engine, compiled, ids, n))
        for k in (4, 8):
            runs = [window_cost(engine, compiled, ids, k) for _ in range(repeats)]
            loop = [min(c) for c in zip(*(r[0] for r in runs))]
            one = [min(c) for c in zip(*(r[1] for r in runs))] if runs[0][1] else []
            w[f"window_k{k}_loop"] = summary(loop)
            if one:
                w[f"window_k{k}_one_call"] = summary(one)
        res["workloads"][name] = w
        print(
            f"{engine.name} {name}: compile {min(compile_ms):.1f} ms, mask warm {w['mask_warm']['mean_us']} us "
            f"(p90 {w['mask_warm']['p90_us']}), k=4 window {w['window_k4_loop']['mean_us']} us",
            flush=True,
        )
    return res


def markdown(result: dict) -> str:
    cpu = result["machine"]
    lines = [
        f"# Grammar engines: mask time per token, Qwen2.5 vocabulary ({VOCAB} logits)",
        "",
        f"Machine: {cpu['model']}, {cpu['cores']} cores, SIMD flags: {' '.join(cpu['simd_flags'])}; "
        f"Python {cpu['python']}, torch {cpu['torch']}. One thread per engine. Made by "
        "`python docs/bench/structured/mask_time.py --xgrammar-path /tmp/xgenv --out "
        "docs/bench/structured/avx2-mask-time` (raw numbers: `results.json`).",
        "",
        "µs unless stated; mask = one next-token bitmask; cold = the first request, warm = the later "
        "passes; *best pass* = each position's fastest of the warm passes, then mean / p90 over "
        "positions: the steady cost with preemption by other processes removed (the machine is shared; "
        "the ~4 ms maxima are scheduler ticks). Window k = the k + 1 masks a k-token chain verifies plus "
        "one rollback of k, best pass per position, mean (Python loop; llguidance's one-call form in "
        "brackets).",
        "",
        "| engine | workload | tokens | compile + 1st mask (ms, best of 3) | mask cold mean / p90 | "
        "mask warm mean / p50 / p90 / max | **mask, best pass: mean / p90** | rollback 1 / 4 / 8 (p50) | "
        "window k=4 | window k=8 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for eng, r in result["engines"].items():
        if "error" in r:
            lines.append(f"| {eng} | — | | {r['error']} | | | | | | |")
            continue
        for wl, w in r["workloads"].items():
            mw, mc = w["mask_warm"], w["mask_cold"]
            win = []
            for k in (4, 8):
                s = f"{w[f'window_k{k}_loop']['mean_us']:.0f}"
                if f"window_k{k}_one_call" in w:
                    s += f" ({w[f'window_k{k}_one_call']['mean_us']:.0f})"
                win.append(s)
            lines.append(
                f"| {eng} {r['version']} | {wl} | {w['tokens']} | {min(w['compile_first_mask_ms']):.1f} | "
                f"{mc['mean_us']:.0f} / {mc['p90_us']:.0f} | {mw['mean_us']:.0f} / {mw['p50_us']:.0f} / "
                f"{mw['p90_us']:.0f} / {mw['max_us']:.0f} | **{w['mask_best_of_passes']['mean_us']:.0f} / "
                f"{w['mask_best_of_passes']['p90_us']:.0f}** | {w['rollback_1']['p50_us']:.1f} / "
                f"{w['rollback_4']['p50_us']:.1f} / {w['rollback_8']['p50_us']:.1f} | {win[0]} | {win[1]} |"
            )
    lines += [
        "",
        "Tokenizer setup (once per tokenizer, s): "
        + ", ".join(f"{e} {r['tokenizer_s']}" for e, r in result["engines"].items() if "tokenizer_s" in r),
        "",
        "Masking logits [9, 151936] along an 8-token drafted chain of the JSON-schema output, at every "
        "position (µs, mean / p50 / p90):",
        "",
    ]
    for name, s in result["apply_k8"].items():
        lines.append(f"- {name}: {s['mean_us']:.0f} / {s['p50_us']:.0f} / {s['p90_us']:.0f}")
    lines += [
        "",
        "Load average (1, 5, 15 min) before / after: "
        f"{result['load_average_before']} / {result['load_average_after']} (the machine is shared).",
        "",
        "The choice made on these numbers (llguidance) and why: "
        "[docs/structured-outputs.md](../../../structured-outputs.md).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: the cached Qwen2.5 one)")
    ap.add_argument("--xgrammar-path", default=None, help="a --target directory holding xgrammar")
    ap.add_argument("--repeats", type=int, default=5, help="warm passes over each output")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--render", action="store_true", help="only rewrite README.md from OUT/results.json")
    args = ap.parse_args()
    if args.render:
        (args.out / "README.md").write_text(markdown(json.loads((args.out / "results.json").read_text())))
        return
    if args.xgrammar_path:
        sys.path.append(args.xgrammar_path)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or default_tokenizer_dir()
    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    result = {
        "machine": cpu_info(),
        "load_average_before": os.getloadavg(),
        "tokenizer": tok_dir,
        "tokenizer_len": len(hf_tok),
        "vocab": VOCAB,
        "engines": {},
    }
    for cls in (LLGuidance, XGrammar):
        try:
            engine = cls(hf_tok)
        except ImportError as e:
            result["engines"][cls.name] = {"error": f"not importable: {e}"}
            continue
        result["engines"][cls.name] = run_engine(engine, hf_tok, args.repeats)
    result["apply_k8"] = apply_costs(hf_tok)
    result["load_average_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "README.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
