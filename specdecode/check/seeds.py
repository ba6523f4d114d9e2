"""Part 5: a seeded request gets the same tokens whatever else is in the batch.

Request X (``seed_setting``, a fixed seed, ``seed_tokens`` tokens, EOS ignored) is run:

* alone, twice (determinism);
* as ``seed_batch`` identical copies in one batch: the rows have identical inputs, so they compute
  identically and must agree exactly. A seed that depends on the batch row, or generators shared
  between rows, breaks this at once;
* at the first, middle and last position of a batch among other requests (other prompts, greedy,
  other seeds, unseeded, different lengths, so rows finish and move slots at different times);

and every batched result is compared with the alone result. Copies must agree exactly. A batched
run that differs from the alone run is a seed fault unless the pair's logits are themselves
batch-variant: then the check measures that (same prompt alone vs as a batch of copies, one token
or a verify window each, target and draft) and reports the divergence as numeric, which does not fail the part (as part 3's near-ties).
With --dtype float32 on CPU the logits are usually batch-invariant to the last bit or nearly so.
"""

from __future__ import annotations

import torch

from specdecode.check.common import CheckConfig, EnginePool, Progress, first_divergence, run_requests
from specdecode.check.report import FAIL, PASS, PartResult
from specdecode.models.base import next_token_logits
from specdecode.sampling import SamplingSetting


def check_seeds(pool: EnginePool, prompts: list[list[int]], cfg: CheckConfig, progress: Progress) -> PartResult:
    b = max(2, cfg.seed_batch)
    x_prompt = prompts[0]
    x_params = cfg.seed_setting.params(seed=cfg.seed + 12345, max_new_tokens=cfg.seed_tokens, ignore_eos=True)
    others = _others(prompts, b - 1, cfg)
    layouts: dict[str, int] = {}
    for name, pos in (("first", 0), ("middle", (b - 1) // 2), ("last", b - 1)):
        if pos not in layouts.values():
            layouts[name] = pos
    progress.part("5 seeds", 3 + len(layouts))

    alone = []
    for _ in range(2):
        alone.append(run_requests(pool.spec(1), [x_prompt], x_params)[0].token_ids)
        progress.advance()
    copies = [r.token_ids for r in run_requests(pool.spec(b), [x_prompt] * b, [x_params] * b)]
    progress.advance()
    mixed = {}
    for name, pos in layouts.items():
        batch_prompts = [p for p, _ in others]
        batch_params = [sp for _, sp in others]
        batch_prompts.insert(pos, x_prompt)
        batch_params.insert(pos, x_params)
        mixed[name] = run_requests(pool.spec(b), batch_prompts, batch_params)[pos].token_ids
        progress.advance()

    checks = [("alone, second run vs first", alone[0], alone[1], True)]
    checks += [(f"copy {i} vs copy 0 in one batch of {b}", copies[0], copies[i], True) for i in range(1, b)]
    checks += [(f"copy 0 in a batch of {b} vs alone", alone[0], copies[0], False)]
    checks += [(f"{name} of {b} among other requests vs alone", alone[0], toks, False) for name, toks in mixed.items()]
    records = []
    for label, ref, got, strict in checks:
        i = first_divergence(ref, got)
        rec = {"comparison": label, "strict": strict, "equal": i is None, "reference": ref, "tokens": got}
        if i is not None:
            rec["divergence"] = {
                "position": i,
                "reference_token": ref[i] if i < len(ref) else None,
                "token": got[i] if i < len(got) else None,
            }
        records.append(rec)

    variance = None
    if any(not r["equal"] and not r["strict"] for r in records):
        variance = batch_variance(pool, x_prompt, b, [p for p, _ in others])
    numeric_possible = bool(variance) and any(v > 0 for v in variance.values())
    for r in records:
        if not r["equal"]:
            r["verdict"] = "numeric (batch-variant logits)" if not r["strict"] and numeric_possible else "seed fault"
    faults = [r for r in records if r.get("verdict") == "seed fault"]
    numeric = [r for r in records if r.get("verdict", "").startswith("numeric")]
    if faults:
        f = faults[0]
        d = f["divergence"]
        status = FAIL
        summary = (
            f"{len(faults)}/{len(records)} comparisons differ; first: {f['comparison']} at token {d['position']} "
            f"({d['reference_token']} vs {d['token']})"
        )
    else:
        status = PASS
        summary = (
            f"seed {x_params.seed} ({cfg.seed_setting.name}, {cfg.seed_tokens} tokens): identical alone, "
            f"as {b} copies in one batch, and at {len(mixed)} positions among other requests"
        )
        if numeric:
            summary += (
                f"; {len(numeric)} batched runs differ from the alone run where the logits are batch-variant "
                f"(max |dlogit| {max(variance.values()):.2g}); --backend torch --dtype float32 separates them"
            )
    details = {
        "x": {"prompt": 0, "setting": cfg.seed_setting.name, "seed": x_params.seed, "tokens": cfg.seed_tokens},
        "batch": b,
        "comparisons": records,
        "logit_batch_variance": variance,
    }
    return PartResult(5, "seeds", status, summary, details)


def _others(prompts: list[list[int]], n: int, cfg: CheckConfig) -> list:
    """Varied neighbours: greedy, other seeds, unseeded, different settings and lengths."""
    kinds = [
        (SamplingSetting(0.0), None),
        (SamplingSetting(0.7, top_p=0.9), cfg.seed + 1),
        (SamplingSetting(1.3), None),
        (SamplingSetting(1.0, top_k=20), cfg.seed + 2),
    ]
    out = []
    for i in range(n):
        setting, seed = kinds[i % len(kinds)]
        params = setting.params(seed=seed, max_new_tokens=max(1, cfg.seed_tokens + 3 * (i % 3) - 2))
        out.append((prompts[(i + 1) % len(prompts)], params))
    return out


def batch_variance(pool: EnginePool, prompt: list[int], b: int, others: list[list[int]] = ()) -> dict[str, float]:
    """Max |logit difference| for ``prompt``'s next token computed alone (one token after a prefill)
    vs as ``b`` copies in a batch, vs ``b`` copies fed as a verify window (the engine's width of
    tokens in one forward), and vs beside ``others`` (other prompts of other lengths, prefilled and
    stepped together, as the requests it is compared among): kernels may change with any of these
    shapes (llama.cpp's do, with the width and with the batch's mix of lengths)."""
    engine = pool.spec(b)
    runners = engine.runners()
    out = {}
    width = max(1, min(engine.window, len(prompt) - 1))
    mix = [prompt] + [p for p in others if len(p) > 1][: b - 1]
    for name, runner in runners.items():
        if runner is None:
            continue
        alone = next_token_logits(runner, prompt)
        worst = 0.0
        for w in sorted({1, width}):
            runner.prefill(list(range(b)), [prompt[:-w]] * b)
            ids = torch.tensor([prompt[-w:]] * b)
            pos = torch.arange(len(prompt) - w, len(prompt))[None].expand(b, -1)
            batched = runner.logits(runner.forward(torch.arange(b), ids, pos).hidden)[:, -1].cpu()
            worst = max(worst, float((batched - alone[None]).abs().max()))
        if len(mix) > 1:
            runner.prefill(list(range(len(mix))), [p[:-1] for p in mix])
            ids = torch.tensor([[p[-1]] for p in mix])
            pos = torch.tensor([[len(p) - 1] for p in mix])
            beside = runner.logits(runner.forward(torch.arange(len(mix)), ids, pos).hidden)[0, -1].cpu()
            worst = max(worst, float((beside - alone).abs().max()))
        out[name] = worst
    return out
