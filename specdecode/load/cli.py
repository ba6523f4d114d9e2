"""`specdecode load`: drive OpenAI-compatible endpoints at increasing load and report where
speculation stops paying.

One ``--endpoint`` measures one server; more compare them (the first is the baseline ``A``, each
other one a candidate ``B``, ``C``, ... reported against it; name them with ``LABEL=URL``). The same
URL may be given twice with different ``--endpoint-body LABEL=JSON`` to compare two configurations
of one server.

Example::

    specdecode load --endpoint off=http://127.0.0.1:8000 --endpoint on=http://127.0.0.1:8001 \\
        --prompts spec-bench --levels 1,2,4,8,16,32 --num-requests 64 --duration 120 \\
        --output-len 128 --extra-body '{"ignore_eos": true, "temperature": 0}' \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --out runs/load-spec
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_LEVELS = {"closed": "1,2,4,8,16,32", "open": "1,2,4,8,16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("Example::", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    target = parser.add_argument_group("endpoints")
    target.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="[LABEL=]URL",
        help="server base URL (http://host:port or .../v1); repeat to compare "
        "(up to 8), first = baseline (default labels A, B, C, ...)",
    )
    target.add_argument("--model", help="model name (default: first of GET /v1/models)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="extra request fields for every endpoint, e.g. '{\"ignore_eos\": true, \"temperature\": 0}'",
    )
    target.add_argument(
        "--endpoint-body",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="extra request fields for one endpoint (merged over --extra-body)",
    )
    target.add_argument(
        "--send-fim-stop",
        action="store_true",
        help="send a fill-in-the-middle prompt's editor rule as specdecode's fim_stop field "
        "(exact; other servers may refuse it); default: as OpenAI's stop ['\\n'] for the "
        "line rule, nothing for the block rule",
    )
    target.add_argument(
        "--fim-markers",
        type=_fim_markers,
        default=None,
        metavar="PREFIX,SUFFIX,MIDDLE",
        help="send a fill-in-the-middle prompt as one prompt in prefix-suffix-middle order with these "
        "markers (e.g. '<|fim_prefix|>,<|fim_suffix|>,<|fim_middle|>' for Qwen2.5-Coder) instead of "
        "OpenAI's suffix field, which some servers ignore (llama-server's /v1/completions completes the "
        "prefix alone); every endpoint then reads the same tokens",
    )
    target.add_argument(
        "--no-response-format",
        dest="response_format",
        action="store_false",
        help="do not send a prompt's response_format (json_extract's JSON schema): unconstrained "
        "decoding of the same prompts; by default it is sent (not with ignore_eos on our server)",
    )
    target.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--prompts",
        default="spec-bench",
        help="spec-bench, humaneval[:dev|:test], fim[:dev|:test] (fill-in-the-middle: requests "
        "carry OpenAI's suffix), code_edit[:dev|:test], json_extract[:dev|:test] (structured output: "
        "requests carry response_format), the sessions editor_replay[:dev|:test] (a file typed into: "
        "successive FIM requests) and chat_turns (MT-Bench's second turns after the endpoint's own first "
        "answer), each session's requests in order, or a .jsonl file (default: spec-bench)",
    )
    work.add_argument("--prompts-path", help="Spec-Bench question.jsonl location")
    work.add_argument("--categories", help="comma-separated categories to keep")
    work.add_argument(
        "--output-len",
        type=_output_len,
        metavar="N|LO:HI",
        help="max_tokens per request, fixed or uniform in [LO, HI] (default: the prompt's own or 128)",
    )
    work.add_argument("--seed", type=int, default=0)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--mode",
        choices=("closed", "open"),
        default="closed",
        help="closed: fixed concurrency; open: Poisson arrivals at a rate",
    )
    sweep.add_argument(
        "--levels",
        type=_levels,
        help="concurrencies (closed) or requests/s (open), comma-separated "
        f"(default: {DEFAULT_LEVELS['closed']} / {DEFAULT_LEVELS['open']})",
    )
    sweep.add_argument("--num-requests", type=int, default=100, help="per level and endpoint")
    sweep.add_argument(
        "--duration",
        type=float,
        default=60.0,
        metavar="S",
        help="time limit per level and endpoint (over all of its --rounds slices)",
    )
    sweep.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="cut each level's requests into N slices and alternate the endpoints slice by "
        "slice (default 1: each endpoint's level in one stretch)",
    )
    sweep.add_argument(
        "--time-limit",
        type=float,
        default=1800.0,
        metavar="S",
        help="time limit for the whole run; later levels are skipped",
    )
    sweep.add_argument("--slo-ttft-ms", type=float, help="goodput target for TTFT")
    sweep.add_argument("--slo-tpot-ms", type=float, help="goodput target for TPOT")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/load-<time>)")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from specdecode.bench.prompts import PromptSetError, load_prompt_set
    from specdecode.load.client import LoadError
    from specdecode.load.report import write_outputs
    from specdecode.load.runner import LoadConfig, run_sweep
    from specdecode.load.stats import Slo

    try:
        targets = _targets(args)
        categories = args.categories.split(",") if args.categories else None
        prompts = load_prompt_set(args.prompts, seed=args.seed, categories=categories, path=args.prompts_path)
        config = LoadConfig(
            targets=targets,
            prompts=prompts,
            mode=args.mode,
            levels=args.levels or _levels(DEFAULT_LEVELS[args.mode]),
            num_requests=args.num_requests,
            duration_s=args.duration,
            time_limit_s=args.time_limit,
            rounds=args.rounds,
            output_len=args.output_len,
            request_timeout_s=args.request_timeout,
            api_key=args.api_key,
            seed=args.seed,
        )
    except (PromptSetError, ValueError) as exc:
        print(f"specdecode load: error: {exc}", file=sys.stderr)
        return 2
    slo = Slo(*(None if ms is None else ms / 1000 for ms in (args.slo_ttft_ms, args.slo_tpot_ms)))
    out = args.out or Path("runs") / time.strftime("load-%Y%m%d-%H%M%S")
    try:
        with _progress(args.no_progress, args.mode) as progress:
            result = run_sweep(config, progress)
    except LoadError as exc:
        print(f"specdecode load: error: {exc}", file=sys.stderr)
        return 1
    write_outputs(result, config, slo, out, prompt_set=args.prompts)
    done = sum(len(run.records) for run in result.levels)
    print(f"{done} requests over {len(result.levels)} levels; report: {out / 'report.md'}")
    if result.interrupted:
        print("interrupted: wrote what finished", file=sys.stderr)
        return 130
    return 0


def _targets(args: argparse.Namespace) -> list[Any]:
    from specdecode.load.client import Target

    from specdecode.load.runner import MAX_ENDPOINTS

    if len(args.endpoint) > MAX_ENDPOINTS:
        raise ValueError(f"give --endpoint at most {MAX_ENDPOINTS} times (one baseline and the candidates)")
    specs = [_split_endpoint(spec, default) for spec, default in zip(args.endpoint, string.ascii_uppercase)]
    bodies: dict[str, dict[str, Any]] = {}
    for item in args.endpoint_body:
        label, sep, text = item.partition("=")
        if not sep or label not in {lbl for lbl, _ in specs}:
            raise ValueError(
                f"--endpoint-body {item!r}: expected LABEL=JSON with LABEL one of {[lbl for lbl, _ in specs]}"
            )
        bodies[label] = _json_object(text)
    return [
        Target(
            label=label,
            url=url,
            model=args.model,
            extra_body={**args.extra_body, **bodies.get(label, {})},
            fim_stop=args.send_fim_stop,
            response_format=args.response_format,
            fim_markers=args.fim_markers,
        )
        for label, url in specs
    ]


def _fim_markers(text: str) -> tuple[str, str, str]:
    markers = tuple(text.split(","))
    if len(markers) != 3 or not all(markers):
        raise argparse.ArgumentTypeError(f"expected three comma-separated markers PREFIX,SUFFIX,MIDDLE, got {text!r}")
    return markers  # type: ignore[return-value]


def _split_endpoint(spec: str, default_label: str) -> tuple[str, str]:
    label, sep, url = spec.partition("=")
    if not sep or "://" in label:
        label, url = default_label, spec
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--endpoint {spec!r}: expected [LABEL=]http(s)://host:port")
    return label, url


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _output_len(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return bounds


def _levels(text: str) -> list[float]:
    try:
        levels = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    return [int(x) if x.is_integer() else x for x in levels]


def _progress(disabled: bool, mode: str) -> Any:
    """A rich progress display (one bar per level) on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdecode.load.records import LevelRun, RequestRecord

    unit = "concurrency" if mode == "closed" else "req/s"

    class RichProgress(Progress):
        def level_started(self, run: LevelRun, total: int) -> None:
            self.errors = 0
            self.task = self.add_task(f"{run.label} {unit}={run.level:g}", total=total, errors=0)

        def request_done(self, run: LevelRun, record: RequestRecord) -> None:
            self.errors += not record.ok
            self.update(self.task, advance=1, errors=self.errors)

    return RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=disabled,
    )
