"""Prefill once per prompt: the check admits the same prompt hundreds of times.

On a CPU a 1.5B model prefills a 60-token prompt in tens of seconds, and parts 2 and 5 admit the
same prompt once per sample. :func:`reuse_prefills` wraps a runner's ``prefill`` so that the first
prefill of a token list stores the K/V it wrote and later prefills of the same list (in any slot,
any engine built on the same model) copy it back. The K/V of a prompt depend only on its tokens up
to floating-point rounding (a batched prefill may round differently from a batch of one), so every
admission of a prompt then sees one of the values the engine itself computed for it.

It goes through the runner interface only (``export_kv``/``import_kv``, keyed by the runner's
``identity``); a prefix cache inside the engine would make it unnecessary.
"""

from __future__ import annotations

from typing import Any

# (runner identity, tokens) -> the runner's snapshot of that prompt's K/V
PrefillStore = dict[tuple[str, tuple[int, ...]], Any]


class _ReusingPrefill:
    def __init__(self, runner, store: PrefillStore) -> None:
        self.runner = runner
        self.compute = runner.prefill  # the runner's own (bound) prefill
        self.store = store

    def __call__(self, slots: list[int], prompts: list[list[int]], layers=()) -> list:
        if layers:  # features are not stored: compute
            return self.compute(slots, prompts, layers)
        keys = [(self.runner.identity, tuple(p)) for p in prompts]
        todo = [i for i, key in enumerate(keys) if prompts[i] and key not in self.store]
        todo = list({keys[i]: i for i in todo}.values())  # each new prompt once
        if todo:
            self.compute([slots[i] for i in todo], [prompts[i] for i in todo])
            for i in todo:
                self.store[keys[i]] = self.runner.export_kv(slots[i], len(prompts[i]))
        done = {slots[i] for i in todo}
        for slot, prompt, key in zip(slots, prompts, keys):
            if prompt and slot not in done:
                self.runner.import_kv(slot, self.store[key])
        return [{} for _ in prompts]


def reuse_prefills(engine, store: PrefillStore | None = None) -> PrefillStore:
    """Make ``engine``'s target runner and draft-model runner (if any) reuse stored prefills.

    Pass the same ``store`` to every engine built on the same models. Returns the store.
    """
    store = {} if store is None else store
    for runner in engine.runners().values():
        if not isinstance(runner.prefill, _ReusingPrefill):
            runner.prefill = _ReusingPrefill(runner, store)
    return store
