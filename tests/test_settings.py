"""One settings object (specdecode.config): every engine flag of every command is made from its
EngineConfig field (one name, one default or the tool's declared one, one list of choices from the
registry that defines them, one help), the config checks itself once with flag-named errors, is frozen,
and a misspelled name fails instead of falling back to a default."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from specdecode import config as C
from specdecode.check.common import CheckConfig
from specdecode.config import ConfigError, DraftSettings, EngineConfig, EngineSettings, config_dict, default

COMMANDS = ("generate", "bench", "check", "serve", "load")
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
CHECK_FIELDS = {f.name: f for f in dataclasses.fields(CheckConfig)}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    from specdecode.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def expected_default(f: dataclasses.Field, tool: str):
    value = f.metadata["tools"].get(tool, f.default)
    return f.metadata["text"](value) if f.metadata.get("text") else value


def walk(parser: argparse.ArgumentParser, command: str) -> tuple[int, list]:
    """(settings flags walked, what is wrong): each flag of a setting must be made from its field."""
    fields = {**(CHECK_FIELDS if command == "check" else {}), **ENGINE_FIELDS}  # -k: the engine's flag
    setting_flags = {flag: name for name, f in fields.items() for flag in f.metadata.get("flags", ())}
    dests = [a.dest for a in flags(parser)]
    wrong = [("two flags", d) for d in set(dests) if dests.count(d) > 1]
    walked = 0
    for action in flags(parser):
        # a setting's flag writes that setting, nowhere else
        wrong += [
            ("writes elsewhere", flag)
            for flag in action.option_strings
            if setting_flags.get(flag, action.dest) != action.dest
        ]
        f = fields.get(action.dest)
        if f is None or not f.metadata:  # not a setting (--parts: its default depends on --sampler)
            continue
        walked += 1
        meta = f.metadata
        if command == "bench" and action.dest == "draft_quantization":  # a sweep: a list of modes
            if action.default != [f.default] or not set(C.DRAFT_MODES) >= set(action.type("none,int8")):
                wrong.append(("sweep", action.dest))
            continue
        if f.default is not dataclasses.MISSING and action.default != expected_default(f, command):
            wrong.append(("default", action.dest, action.default))
        if not (action.help or "").startswith(meta["help"]):  # the field's help
            wrong.append(("help", action.dest))
        if tuple(action.choices or ()) != tuple(meta["choices"] or ()):
            wrong.append(("choices", action.dest))
        if action.option_strings != list(meta["flags"]):
            wrong.append(("flags", action.dest))
    return walked, wrong


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_has_one_definition(command):
    walked, wrong = walk(subparsers()[command], command)
    assert wrong == []
    if command == "load":
        assert walked == 0  # the load generator has no engine flags (it drives an endpoint)
    else:  # --target, --draft, the model settings; serve's batch flags; check's own budgets
        from specdecode.build import MODEL_SETTINGS

        serve = (
            ("max_batch_size", "max_num_batched_tokens", "batched_tokens_per_seq", "prefix_cache_mb")
            if command == "serve"
            else ("prefix_cache_mb",)  # check runs its parts with the prefix cache when asked (forced hits)
            if command == "check"
            else ()
        )
        check = [f for f in CHECK_FIELDS.values() if f.metadata.get("flags")] if command == "check" else []
        assert walked == 2 + len(MODEL_SETTINGS) + len(serve) + len(check)


def test_the_walk_finds_a_flag_defined_by_hand():
    """Negative control: a command that writes its own copy of a setting's flag is caught."""
    from specdecode.build import add_model_arguments

    for rogue in (
        {"default": 4},  # another default
        {"default": 8, "help": "sequences decoded together"},  # serve's value, its own help
        {"default": 1, "dest": "batch"},  # the flag written elsewhere
    ):
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        parser.add_argument(
            "--max-batch-size", type=int, **{"help": C._FIELDS["max_batch_size"].metadata["help"], **rogue}
        )
        assert walk(parser, "generate")[1], rogue


def test_tool_defaults_are_declared_beside_the_field_and_used():
    parsers = subparsers()
    serve = parsers["serve"].parse_args(["--target", "t"])
    cfg = C.config_from_args(serve, "serve")
    assert cfg == EngineConfig("t", **C.tool_defaults("serve"))  # the flags add nothing of their own
    assert (cfg.max_batch_size, cfg.max_num_batched_tokens) == (default("max_batch_size", "serve"), 512)
    assert cfg.first_token_from_target and cfg.isolate_drafter_faults
    assert (EngineConfig("t").max_batch_size, EngineConfig("t").max_num_batched_tokens) == (1, None)
    generate = parsers["generate"].parse_args(["--target", "t", "--prompt", "x"])
    cfg = C.config_from_args(generate, "generate", max_batch_size=3)
    assert cfg.first_token_from_target and not cfg.isolate_drafter_faults and cfg.max_batch_size == 3
    for name, f in ENGINE_FIELDS.items():  # every declared tool default is a valid value
        for tool, value in f.metadata.get("tools", {}).items():
            EngineConfig("t", **{name: value})
            assert tool in COMMANDS, (name, tool)


def test_choices_come_from_the_registries():
    from specdecode.models import backends
    from specdecode.models.quantize import DRAFT_MODES, TARGET_MODES
    from specdecode.sampling import SAMPLERS

    assert tuple(C.SAMPLERS) == SAMPLERS
    assert tuple(C.BACKENDS) == ("auto", *backends.names())
    assert tuple(C.DRAFT_MODES) == DRAFT_MODES and tuple(C.TARGET_MODES) == TARGET_MODES
    for name, f in ENGINE_FIELDS.items():
        if f.metadata.get("choices") is not None:
            assert f.default in f.metadata["choices"], name  # (the config does not ask this of its defaults)


def test_the_policy_and_selector_defaults_are_the_settings():
    from specdecode.policy import AcceptancePolicy
    from specdecode.selector import CATCH_UP_TOKENS

    policy = AcceptancePolicy()
    assert (policy.start_k, policy.max_k) == (C.DEFAULTS.num_draft_tokens, C.DEFAULTS.max_draft_tokens)
    assert C.DEFAULTS.catch_up_tokens == CATCH_UP_TOKENS
    assert CheckConfig().num_draft_tokens == C.DEFAULTS.num_draft_tokens


BAD = [
    ({"num_draft_tokens": -1}, "--num-draft-tokens must be >= 0"),
    ({"num_draft_tokens": 2.5}, "--num-draft-tokens must be an integer"),
    ({"num_draft_tokens": None}, "--num-draft-tokens must be given"),
    ({"max_batch_size": 0}, "--max-batch-size must be >= 1"),
    ({"max_context": 0}, "--max-context must be >= 1"),
    ({"draft_policy": "greedy"}, "--draft-policy must be fixed, acceptance or auto"),
    ({"max_draft_tokens": 0}, "--max-draft-tokens must be >= 1"),
    ({"catch_up_tokens": 0}, "--catch-up-tokens must be >= 1"),
    ({"verify_budget": -1}, "--verify-budget must be >= 0"),
    ({"draft_quantization": "int3"}, "--draft-quantization must be none, int8"),
    ({"target_quantization": "auto"}, "--target-quantization must be none, int8 or int4"),
    ({"tree_topk": 0}, "--tree-topk must be >= 1"),
    ({"tree_nodes": 0}, "--tree-nodes must be >= 1"),
    ({"acceptance": "lossy"}, "--acceptance must be exact or typical"),
    ({"acceptance": "typical", "typical_epsilon": 2.0}, "typical acceptance needs 0 < epsilon <= 1"),
    ({"sampler": "gumbel"}, "--sampler must be rejection or coupled"),
    ({"sampler": "coupled", "acceptance": "typical"}, "--sampler coupled verifies by its own rule"),
    ({"batch_invariant": "sometimes"}, "--batch-invariant must be auto, on or off"),
    ({"batch_invariant": "on", "tree_topk": 2}, "--batch-invariant covers chain drafting only"),
    ({"backend": "vllm"}, "--backend must be auto, .*torch"),
    ({"threads": 0}, "--threads must be >= 1"),
    ({"weights": "paged"}, "--weights must be resident or mapped"),
    ({"device": "tpu"}, "--device: unknown device"),
    ({"dtype": "int8"}, "--dtype: unknown dtype"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be >= 1"),
    ({"batched_tokens_per_seq": -1}, "--batched-tokens-per-seq must be >= 0"),
    ({"extra_drafts": ("suffix",)}, "need --draft-policy auto"),
    ({"draft_policy": "auto", "draft": None}, "give at least one --draft"),
    ({"draft_policy": "auto", "tree_topk": 2}, "chooses among chains"),
    ({"draft_policy": "auto", "extra_drafts": ("ngram",)}, "given twice"),
]


@pytest.mark.parametrize(("changes", "message"), BAD, ids=[next(iter(c)) + f"-{i}" for i, (c, _) in enumerate(BAD)])
def test_a_bad_value_is_refused_with_the_flag_named(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        EngineConfig("t", **{"draft": "ngram", **changes})


def test_the_config_is_frozen_and_a_misspelled_name_fails():
    cfg = EngineConfig("t", "ngram", num_draft_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_draft_tokens = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="num_draft"):
        EngineConfig("t", "ngram", num_draft=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="--tree-topk"):  # a copy with a change is checked too
        dataclasses.replace(cfg, tree_topk=0)
    assert EngineConfig("t", batch_invariant=True).batch_invariant == "on"  # a bool is taken by its name


def test_drafters_read_their_typed_slice_and_nothing_falls_back():
    from specdecode.drafters import DraftContext, build_drafter

    ngram = build_drafter("ngram", DraftContext(None, DraftSettings(tree_topk=2, tree_nodes=5)))
    assert (ngram.tree_topk, ngram.max_tree_nodes) == (2, 5)
    assert build_drafter("ngram", DraftContext(None, None)).max_tree_nodes == 0  # None: every default (chains)
    with pytest.raises(AttributeError, match="tree_topk"):  # an object without the field fails, never defaults
        build_drafter("ngram", DraftContext(None, SimpleNamespace(tree_k=2, tree_nodes=5)))
    slice_ = EngineConfig("t", "ngram", draft_confidence=0.3, tree_topk=3, tree_nodes=9).draft_settings(True)
    assert slice_ == DraftSettings(0.3, 3, 9, True)
    with pytest.raises(ConfigError, match="--tree-nodes"):
        DraftSettings(tree_nodes=0)


def test_the_engine_takes_its_settings_slice():
    from tiny import make_tokenizer

    from specdecode.engine import Engine
    from specdecode.models.backends.toy import ToyRunner

    cfg = EngineConfig("t", "ngram", max_batch_size=2, max_num_batched_tokens=32, sampler="coupled")
    settings = cfg.engine_settings(48, lossy={"acceptance": "x"})
    engine = Engine(ToyRunner(16), make_tokenizer(16), None, 0, settings)
    assert (engine.max_batch_size, engine.max_context, engine.max_num_batched_tokens) == (2, 48, 32)
    assert (engine.sampler, engine.lossy, engine.settings) == ("coupled", {"acceptance": "x"}, settings)
    for bad, message in (
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be >= 1"),
        ({"batched_tokens_per_seq": -1}, "--batched-tokens-per-seq"),
        ({"sampler": "x"}, "--sampler must be rejection or coupled"),
        ({"max_context": 0}, "--max-context must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            EngineSettings(**bad)


def test_a_replica_makes_the_config_again_and_so_checks_it():
    cfg = EngineConfig("t", "ngram", max_batch_size=8, first_token_from_target=True)
    values = config_dict(cfg)
    assert EngineConfig(**values) == cfg
    with pytest.raises(ConfigError, match="--max-batch-size"):
        EngineConfig(**{**values, "max_batch_size": 0})


def test_a_build_checks_the_config_once_not_again(monkeypatch):
    """The config is checked when it is made; building an engine from it checks nothing of it again."""
    from specdecode.build import build_engine

    cfg = EngineConfig("toy:0", "ngram", backend="toy", max_context=64)
    made = []
    post_init = EngineConfig.__post_init__
    monkeypatch.setattr(EngineConfig, "__post_init__", lambda self: made.append(1) or post_init(self))
    engine = build_engine(cfg)
    assert made == [] and engine.max_context == 64 and engine.drafter is not None


def test_the_check_config_is_made_from_its_flags_in_one_call():
    from specdecode.check import cli

    parser = subparsers()["check"]
    assert cli.config_from_args(parser.parse_args(["--target", "t", "--draft", "d"])) == CheckConfig()
    args = parser.parse_args(
        ["--target", "t", "--draft", "d", "-k", "3", "--law-samples", "10", "--coupled-draft-lengths", "2,3"]
    )
    cfg = cli.config_from_args(args)
    assert (cfg.num_draft_tokens, cfg.law_samples, cfg.coupled_ks) == (3, 10, (2, 3))
    for flag, value in (("--law-samples", "0"), ("--alpha", "2"), ("--coupled-setting", "greedy"), ("-k", "0")):
        name = "--num-draft-tokens" if flag == "-k" else flag
        with pytest.raises(ConfigError, match=name):
            cli.config_from_args(parser.parse_args(["--target", "t", "--draft", "d", flag, value]))
