"""The prefix cache under churn, in one process: no growth of the process's memory per request or eviction.

Usage: python docs/bench/sessions/leak_check.py [llamacpp|torch] [REQUESTS]

A tiny random model pair from tests/tiny.py (llama.cpp through a GGUF copy of its weights, or torch), an
engine with a 1 MiB prefix-cache budget (target and draft together), and REQUESTS batches of 1-3 prompts cut
from 40 random "files" at random points (each sharing a prefix with earlier ones), so entries are saved,
restored, superseded and evicted thousands of times. Prints the process's RSS and both caches' sizes every
250 batches: RSS that stays flat while evictions climb means the cache frees what it evicts and nothing per
request is kept. (A real server's RSS also moves with the allocator and llama.cpp's buffers: rss_churn.sh.)
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from specdecode.sampling import SamplingParams
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
backend = sys.argv[1] if len(sys.argv) > 1 else "llamacpp"
requests = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
target = make_model(V, seed=3, hidden=64, layers=2)
engine = make_engine(
    target,
    make_tokenizer(V),
    perturbed_copy(target, noise=0.3),
    k=3,
    num_slots=4,
    max_len=256,
    backend=None if backend == "torch" else backend,
    prefix_cache_mb=1,
)
rng = random.Random(0)
files = [[rng.randrange(1, V - 1) for _ in range(200)] for _ in range(40)]
params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


for i in range(requests + 1):
    f = rng.choice(files)
    cut = rng.randrange(20, 190)
    prompts = [f[:cut] + [rng.randrange(1, V - 1)] for _ in range(rng.choice([1, 2, 3]))]
    engine.generate(prompts, [params] * len(prompts))
    if i % 250 == 0:
        index, draft = engine.prefix_cache.index, engine.drafter.prefixes.index
        print(
            f"{i} batches: RSS {rss_mb():.1f} MiB; target cache {index.nbytes} B in {len(index)} entries, "
            f"{index.stats.evictions} evictions; draft cache {draft.nbytes} B",
            flush=True,
        )
