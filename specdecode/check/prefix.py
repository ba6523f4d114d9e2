"""Prefill once per prompt: the check admits the same prompt hundreds of times.

On a CPU a 1.5B model prefills a 60-token prompt in tens of seconds, and parts 2 and 5 admit the
same prompt once per sample. :func:`reuse_prefills` wraps a runner's ``prefill`` so that the first
prefill of a token list stores the K/V it wrote and later prefills of the same list (in any slot,
any engine built on the same model) copy it back. The K/V of a prompt depend only on its tokens up
to floating-point rounding (a batched prefill may round differently from a batch of one), so every
admission of a prompt then sees one of the values the engine itself computed for it.

It goes through the runner interface only (``export_kv``/``import_kv``, keyed by the runner's
``identity``). With the engine's own prefix cache on (``--prefix-cache-mb``), the speculative engines
restore their prompts from that instead (:mod:`specdecode.check.cache_hits`): this then serves the
reference, which keeps no cache, and the prefills the cache leaves whole.
"""

from __future__ import annotations

from typing import Any

# (runner identity, tokens[, feature layers]) -> (the runner's snapshot of that prompt's K/V, its features)
PrefillStore = dict[tuple[str, tuple[int, ...]], Any]


class _ReusingPrefill:
    def __init__(self, runner, store: PrefillStore) -> None:
        self.runner = runner
        self.compute = runner.prefill  # the runner's own (bound) prefill
        self.store = store

    def __call__(self, slots: list[int], prompts: list[list[int]], layers=(), starts=None) -> list:
        if starts is not None and any(starts):  # a prompt's later chunk: not a whole prompt to reuse
            return self.compute(slots, prompts, layers, starts=starts)
        layers = tuple(layers)  # features (for drafters that read them) are stored beside the K/V
        keys = [(self.runner.identity, tuple(p)) + ((layers,) if layers else ()) for p in prompts]
        todo = [i for i, key in enumerate(keys) if prompts[i] and key not in self.store]
        todo = list({keys[i]: i for i in todo}.values())  # each new prompt once
        if todo:
            feats = self.compute([slots[i] for i in todo], [prompts[i] for i in todo], layers)
            for i, f in zip(todo, feats):
                self.store[keys[i]] = (self.runner.export_kv(slots[i], len(prompts[i])), f)
        done = {slots[i] for i in todo}
        out = []
        for slot, prompt, key in zip(slots, prompts, keys):
            if prompt and slot not in done:
                self.runner.import_kv(slot, self.store[key][0])
            out.append(self.store[key][1] if prompt else self.compute([slot], [prompt], layers)[0])
        return out


def reuse_prefills(engine, store: PrefillStore | None = None) -> PrefillStore:
    """Make ``engine``'s target runner and draft-model runner (if any) reuse stored prefills.

    Pass the same ``store`` to every engine built on the same models. Returns the store. Runners that
    do not promise exact snapshots (``Runner.kv_snapshots_exact``: llama.cpp's) prefill for real.
    """
    store = {} if store is None else store
    for runner in engine.runners().values():
        if runner.kv_snapshots_exact and not isinstance(runner.prefill, _ReusingPrefill):
            runner.prefill = _ReusingPrefill(runner, store)
    return store
