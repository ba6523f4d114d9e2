"""A session's requests at run time: which prompts go together, their answer slots filled from the
session's earlier answers, and (with :func:`specdecode.drafters.base.common_prefix`) how much of a prompt a prefix cache
holding the previous one can reuse.

The session workloads themselves (``editor_replay``, ``chat_turns``) are prompt sets
(:func:`specdecode.bench.prompts.load_prompt_set`); a :class:`~specdecode.bench.prompts.Prompt` with a
``session`` goes in order with the others of its session, each sent when the one before it has ended. An
assistant message whose content is ``None`` is a slot for the session's earlier answers, filled in order
by :func:`with_history` when the request is sent.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import groupby

from specdecode.bench.prompts import Prompt


def with_history(prompt: Prompt, answers: list[str]) -> Prompt:
    """``prompt`` with its answer slots filled, in order, from ``answers`` (the session's earlier answers)."""
    slots = [i for i, m in enumerate(prompt.messages or []) if m.get("role") == "assistant" and m["content"] is None]
    if not slots:
        return prompt
    if len(answers) < len(slots):
        raise ValueError(f"{prompt.id} needs {len(slots)} earlier answer(s) of its session, got {len(answers)}")
    messages = [dict(m) for m in prompt.messages or []]
    for slot, answer in zip(slots, answers[-len(slots) :]):
        messages[slot]["content"] = answer
    return replace(prompt, messages=messages)


def needs_history(prompt: Prompt) -> bool:
    """Whether ``prompt`` holds slots for earlier answers (it cannot be sent before they are known)."""
    return any(m.get("role") == "assistant" and m.get("content") is None for m in prompt.messages or [])


def sessions(prompts: list[Prompt]) -> list[list[Prompt]]:
    """``prompts`` as units that go in order: a session's requests (by turn), or one request alone."""
    units: list[list[Prompt]] = []
    for key, group in groupby(prompts, key=lambda p: p.session):
        items = list(group)
        units.extend([sorted(items, key=lambda p: p.turn)] if key is not None else [[p] for p in items])
    return units
