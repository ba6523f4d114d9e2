"""Server pieces without a server: the drafter guard's bookkeeping, prompt forms, CLI flags."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from specdecode.drafters.base import DrafterBase, Proposal
from specdecode.server import protocol as P
from specdecode.server.cli import add_arguments, check_arguments, server_config
from specdecode.drafters.guard import GuardedDrafter


class FakeDrafter(DrafterBase):
    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: set[str] = set()

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail:
            raise RuntimeError(f"{what} failed")

    def start(self, slots, prompts):
        self._maybe_fail("start")
        self.calls.append(("start", list(slots)))

    def propose(self, seqs, num_tokens):
        self._maybe_fail("propose")
        self.calls.append(("propose", list(num_tokens)))
        k = max(num_tokens)
        return Proposal(torch.ones(len(seqs), k, dtype=torch.long), None, torch.tensor(num_tokens))

    def move(self, src, dst):
        self._maybe_fail("move")
        self.calls.append(("move", src, dst))

    def release(self, slot):
        self.calls.append(("release", slot))


def seq(slot: int, rid: str):
    return SimpleNamespace(slot=slot, request_id=rid, token_ids=[1, 2], params=None, generator=None)


def test_guard_drafts_only_for_live_rows():
    inner, failures = FakeDrafter(), []
    guard = GuardedDrafter(inner, failures.append)
    guard.start([0, 2], [[1], [3]])
    p = guard.propose([seq(0, "a"), seq(1, "b"), seq(2, "c")], [3, 3, 3])
    assert inner.calls[-1] == ("propose", [3, 0, 3]) and p.num_tokens.tolist() == [3, 0, 3]
    p = guard.propose([seq(1, "b")], [3])
    assert p.tokens.shape == (1, 0) and p.num_tokens.tolist() == [0] and inner.calls[-1][0] == "propose"
    assert failures == []


def test_guard_absorbs_failures_and_releases_the_rows_involved():
    inner, failures = FakeDrafter(), []
    guard = GuardedDrafter(inner, failures.append)
    inner.fail = {"start"}
    guard.start([0], [[1]])
    assert guard.live == set() and failures == ["start"]
    inner.fail = set()
    guard.start([1, 2], [[1], [2]])
    inner.fail = {"propose"}
    p = guard.propose([seq(0, "a"), seq(1, "b"), seq(2, "c")], [2, 2, 0])
    assert p.num_tokens.tolist() == [0, 0, 0] and failures == ["start", "propose"]
    assert guard.live == {2} and ("release", 1) in inner.calls  # slot 2 drafted nothing: untouched
    inner.fail = {"move"}
    guard.move(2, 0)
    assert guard.live == set() and failures[-1] == "move"


def test_guard_follows_moves_and_ignores_unknown_slots():
    inner = FakeDrafter()
    guard = GuardedDrafter(inner)
    guard.start([0, 1], [[1], [2]])
    guard.release(0)
    guard.move(1, 0)
    assert guard.live == {0}
    guard.move(5, 1)  # never started there (e.g. its start failed): nothing to move
    guard.release(7)
    assert inner.calls[-2:] == [("release", 0), ("move", 1, 0)]


@pytest.mark.parametrize("prompt,expected", [("ab", "ab"), (["ab"], "ab"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])])
def test_prompt_forms(prompt, expected):
    assert P.prompt_input(prompt) == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [True, 1], [[1], [2]], {"a": 1}, None, 3.5])
def test_bad_prompt_forms(prompt):
    with pytest.raises(P.APIError) as err:
        P.prompt_input(prompt)
    assert err.value.status == 400 and err.value.param == "prompt"


def test_sampling_defaults_follow_openai():
    req = P.parse(P.CompletionRequest, {"prompt": "x"})
    params = P.sampling_params(req, req.max_tokens, P.COMPLETIONS_DEFAULT_MAX_TOKENS)
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (1.0, 1.0, 0, 16)
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    chat = P.parse(
        P.ChatCompletionRequest,
        {"messages": [{"role": "user", "content": parts}], "max_completion_tokens": 5, "top_k": -1},
    )
    assert P.chat_messages(chat) == [{"role": "user", "content": "hi"}]
    assert P.sampling_params(chat, P.requested_max_tokens(chat), 99).max_new_tokens == 5


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            "t",
            "--draft",
            "d",
            "-k",
            "5",
            "--max-batch-size",
            "16",
            "--max-queue",
            "4",
            "--api-key",
            "k",
            "--no-speculation",
            "--max-num-batched-tokens",
            "64",
        ]
    )
    assert check_arguments(args) is None
    cfg = server_config(args)
    assert (cfg.model_name, cfg.api_key, cfg.max_queue, cfg.speculation) == ("t", "k", 4, False)
    from specdecode.build import ConfigError, config_from_args, validate_config

    plan = config_from_args(args, max_batch_size=args.max_batch_size, first_token_from_target=True)
    assert plan.max_num_batched_tokens == 64 and plan.max_batch_size == 16 and plan.num_draft_tokens == 5
    assert plan.batched_tokens_per_seq == 0  # the default: a fixed budget
    scaled = parser.parse_args(["--target", "t", "--batched-tokens-per-seq", "64"])
    assert check_arguments(scaled) is None and config_from_args(scaled).batched_tokens_per_seq == 64
    assert config_from_args(scaled).max_num_batched_tokens == 512  # serve's default step budget
    for flag in ("--batched-tokens-per-seq", "--max-num-batched-tokens"):
        with pytest.raises(ConfigError, match=flag):
            validate_config(config_from_args(parser.parse_args(["--target", "t", flag, "-1"])))
    assert args.host == "127.0.0.1"
    assert "--max-queue" in check_arguments(parser.parse_args(["--target", "t", "--max-queue", "0"]))


def test_cli_connection_and_host_flags():
    from specdecode.server.cli import connection_limits

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            "t",
            "--allowed-hosts",
            "api.example, other.example",
            "--max-connections",
            "100",
            "--header-timeout",
            "5",
            "--body-timeout",
            "7",
        ]
    )
    assert check_arguments(args) is None
    cfg, limits = server_config(args), connection_limits(args)
    assert cfg.allowed_hosts == ("api.example", "other.example") and cfg.body_timeout_s == 7
    assert (limits.max_connections, limits.header_timeout_s) == (100, 5)
    defaults = parser.parse_args(["--target", "t"])
    assert server_config(defaults).allowed_hosts == () and connection_limits(defaults).max_connections >= 8
    for flag in ("--max-connections", "--header-timeout", "--body-timeout"):
        assert flag in check_arguments(parser.parse_args(["--target", "t", flag, "0"]))
