"""What every part of the check shares: its configuration, sampling settings, an engine pool, a
progress hook, and small helpers to run requests and compare token lists."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from specdecode.config import ConfigError, check_fields, default, setting
from specdecode.engine import Engine
from specdecode.metrics import SpecStats
from specdecode.sampling import SamplingParams, SamplingSetting, parse_setting

# (num_draft_tokens, max_batch_size) -> a fresh Engine; num_draft_tokens == 0 means target-only
EngineFactory = Callable[[int, int], Engine]


def parse_settings(spec: str) -> tuple[SamplingSetting, ...]:
    """``"greedy;t=1;t=0.7,p=0.9;k=20"`` -> settings, each as :func:`specdecode.sampling.parse_setting`
    reads it (t: temperature, k: top-k, p: top-p; t defaults to 1)."""
    out = tuple(parse_setting(item) for item in filter(None, (s.strip() for s in spec.split(";"))))
    if not out:
        raise ValueError("no sampling settings given")
    return out


DEFAULT_LAW_SETTINGS = parse_settings("greedy;t=1;t=0.7,p=0.9;k=20;t=1.3")
DEFAULT_E2E_SETTINGS = parse_settings("t=1")

PART_NAMES = {
    1: "verifier law",
    2: "end-to-end sampling law",
    3: "greedy equality",
    4: "stop and length accounting",
    5: "seeds",
    6: "coupled sampler",
}
OPTIONAL_PARTS = {6}  # run when asked (the CLI asks with --sampler coupled); not listed otherwise


def setting_names(settings: tuple[SamplingSetting, ...]) -> str:
    """Settings as ``--law-settings`` takes them: :func:`parse_settings`'s inverse."""
    return ";".join("greedy" if s.greedy else _setting_text(s) for s in settings)


def _setting_text(s: SamplingSetting) -> str:
    return ",".join(
        [f"t={s.temperature:g}"] + ([f"k={s.top_k}"] if s.top_k else []) + ([f"p={s.top_p:g}"] if s.top_p < 1 else [])
    )


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> draft lengths, each >= 1."""
    try:
        ks = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise ValueError(f"must list draft lengths >= 1, got {text!r}")
    return ks


def _budget(default: int, flag: str, help: str) -> Any:
    return setting(default, flag, type=int, minimum=1, help=help + " (default %(default)s)")


@dataclass
class CheckConfig:
    """Budgets of every part: each field is its flag's one definition (``specdecode check`` makes its flags
    from them and this config from its flags in one call). ``alpha`` is the false-alarm probability of the
    whole check: half goes to part 1 and half to part 2, Bonferroni-split across their tests; parts 3-5
    are exact comparisons. Checked when made."""

    # the draft length of every speculative engine: the engine's setting (its flag is the model flags')
    num_draft_tokens: int = setting(default("num_draft_tokens"), type=int, minimum=1)
    parts: tuple[int, ...] = (1, 2, 3, 4, 5)  # --parts (its default depends on --sampler: check.cli)
    alpha: float = setting(
        1e-3,
        "--alpha",
        type=float,
        help="false-alarm probability of the whole check, split over parts 1-2 (default %(default)g)",
    )
    seed: int = setting(0, "--seed", type=int, help="seed of every random draw the check makes (default %(default)s)")
    # part 1: verifier law on the pair's real distributions
    law_contexts: int = _budget(3, "--law-contexts", "part 1: contexts")
    law_samples: int = _budget(2000, "--law-samples", "part 1: verification steps per context and setting")
    law_settings: tuple[SamplingSetting, ...] = setting(
        DEFAULT_LAW_SETTINGS,
        "--law-settings",
        parse=lambda text: parse_settings(text),
        text=setting_names,
        help="part 1: ';'-separated settings, 'greedy' or t=..,k=..,p=.. (default %(default)r)",
    )
    # part 2: end-to-end two-sample test
    e2e_prompts: int = _budget(1, "--e2e-prompts", "part 2: prompts")
    e2e_samples: int = _budget(64, "--e2e-samples", "part 2: samples per group, prompt and setting")
    e2e_tokens: int = _budget(2, "--e2e-tokens", "part 2: tokens per sample")
    e2e_batch: int = _budget(16, "--e2e-batch", "part 2: batch size")
    e2e_settings: tuple[SamplingSetting, ...] = setting(
        DEFAULT_E2E_SETTINGS,
        "--e2e-settings",
        parse=lambda text: parse_settings(text),
        text=setting_names,
        help="part 2: settings (default %(default)r)",
    )
    # part 3: greedy equality
    greedy_tokens: int = _budget(12, "--greedy-tokens", "part 3: tokens per prompt")
    greedy_batch: int = _budget(4, "--greedy-batch", "part 3: batch size > 1")
    # part 4: stops and length
    stop_tokens: int = _budget(12, "--stop-tokens", "part 4: learning-run tokens")
    # part 5: seeds
    seed_tokens: int = _budget(8, "--seed-tokens", "part 5: tokens per request")
    seed_batch: int = _budget(3, "--seed-batch", "part 5: batch size")
    seed_setting: SamplingSetting = SamplingSetting(1.0)
    # part 6: the coupled sampler (--sampler coupled): seeded equality, and its law on part 1's contexts
    coupled_tokens: int = _budget(16, "--coupled-tokens", "part 6: tokens per seeded request")
    coupled_ks: tuple[int, ...] = setting(
        (2, 4, 8),
        "--coupled-draft-lengths",
        parse=parse_lengths,
        text=lambda ks: ",".join(map(str, ks)),
        metavar="K,...",
        help="part 6: draft lengths compared with target-only decoding (default %(default)s)",
    )
    coupled_setting: SamplingSetting = setting(
        SamplingSetting(0.7),
        "--coupled-setting",
        parse=parse_setting,
        text=_setting_text,
        help="part 6: the sampling setting (default %(default)r)",
    )
    coupled_samples: int = _budget(2000, "--coupled-samples", "part 6: seeds per context and setting of the law test")

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ConfigError(
                "--num-draft-tokens must be >= 1: the check compares speculation with target-only decoding"
            )
        check_fields(self)
        if not self.parts or any(p not in range(1, 8) for p in self.parts):
            raise ConfigError(f"--parts must list numbers 1-7, got {','.join(map(str, self.parts))!r}")
        if not 0 < self.alpha < 1:
            raise ConfigError("--alpha must be in (0, 1)")
        if self.coupled_setting.greedy:
            raise ConfigError("--coupled-setting must sample (T > 0): greedy decoding is part 3's")

    @property
    def statistical_parts(self) -> list[int]:
        return [p for p in (1, 2, 6) if p in self.parts]

    def part_alpha(self) -> float:
        """Each statistical part gets an equal share of ``alpha``."""
        return self.alpha / max(1, len(self.statistical_parts))

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("law_settings", "e2e_settings"):
            out[key] = [s.name for s in getattr(self, key)]
        out["seed_setting"] = self.seed_setting.name
        out["coupled_setting"] = self.coupled_setting.name
        return out


class Progress(Protocol):
    def part(self, name: str, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    def part(self, name: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class TqdmProgress:
    """One tqdm bar per part."""

    def __init__(self) -> None:
        self._bar = None

    def part(self, name: str, total: int) -> None:
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=total, desc=name, unit="step", leave=True, dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class EnginePool:
    """Engines by (draft length, batch size), built once from the factory and reused by every part.

    ``spec(b)`` drafts ``num_draft_tokens``; ``target_only(b)`` drafts nothing (the reference).
    """

    def __init__(self, factory: EngineFactory, num_draft_tokens: int) -> None:
        self.factory = factory
        self.k = num_draft_tokens
        self._engines: dict[tuple[int, int], Engine] = {}
        self._eos: dict[tuple[int, int], set[int]] = {}

    def spec(self, batch: int) -> Engine:
        return self._get(self.k, batch)

    def target_only(self, batch: int) -> Engine:
        return self._get(0, batch)

    def engines(self) -> list[Engine]:
        """The engines built so far."""
        return list(self._engines.values())

    def engine(self, k: int, batch: int) -> Engine:
        """An engine drafting ``k`` tokens (0: target-only) at ``batch``."""
        return self._get(k, batch)

    def _get(self, k: int, batch: int) -> Engine:
        key = (k, batch)
        if key not in self._engines:
            self._engines[key] = self.factory(k, batch)
            self._eos[key] = set(self._engines[key].eos_token_ids)
        engine = self._engines[key]
        for seq in list(engine.running):  # a part that failed half-way may leave requests behind
            engine.abort(seq)
        engine.eos_token_ids = set(self._eos[key])
        return engine


@dataclass
class Run:
    """One finished request, with how its tokens arrived (``blocks[i]`` = tokens added by step i)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    blocks: list[int] = field(default_factory=list)

    def block_of(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of the step block that emitted output token ``index``."""
        start = 0
        for size in self.blocks:
            if index < start + size:
                return start, start + size
            start += size
        raise IndexError(index)


def run_requests(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams] | SamplingParams,
    on_finish: Callable[[], None] | None = None,
) -> list[Run]:
    """Like ``Engine.generate`` (same admission order and batching), but also records per-step blocks."""
    blocks: dict[str, list[int]] = {}
    done: dict[str, Run] = {}
    for ev in engine.stream(prompts, params):
        s = ev.seq
        blocks.setdefault(s.request_id, []).append(len(ev.new_token_ids))
        if ev.finished:
            done[s.request_id] = Run(
                list(s.output_ids), s.text.finish(), s.finish_reason, s.stats, blocks[s.request_id]
            )
            if on_finish is not None:
                on_finish()
    return [done[str(i)] for i in range(len(prompts))]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the lists differ (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
