"""A long API fuzz run of the OpenAI-compatible server: the strategies and the property of
``tests/test_server_fuzz.py`` (never a 5xx; OpenAI-shaped 4xx errors; streams end with ``[DONE]``; a
tiny nonzero temperature answers as greedy does), but every violation is collected instead of
stopping at the first.

By default it serves the tests' tiny model pair in-process (built in code: no downloads, CPU) and
attaches to each violation the server-side traceback that the request logged. With
``--endpoint URL --api-key K --model M`` it fuzzes any running server instead (no tracebacks then).

    python scripts/fuzz_server.py --examples 3000 --seed 1 --out fuzz.json
    python scripts/fuzz_server.py --strategies structured --examples 10000   # schemas, regexes, grammars

In-process, the summary also counts the grammar sandbox's restarts (each a child that crashed, ran out of
time or memory on a spec: the server itself never dies).

The ``--out`` JSON summary: examples run, a histogram of statuses, and one entry per distinct cause
(the kind of violation and the innermost server frame of the traceback it logged) with its count and
the smallest request that showed it (body truncated). The exit status is 1 when any violation was found.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import re
import sys
import time
import traceback
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import test_server_fuzz as F

BODY_LIMIT = 2000  # characters of a request body kept in the summary


class _Tracebacks(logging.Handler):
    """The server's log records (``specdecode.*``) that carry an exception, since the last ``clear()``.

    The server logs an error before it answers; uvicorn's "Exception in ASGI application" repeats
    it after the answer (when the next request may be running already), so only the server's count."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.since = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.name.startswith("specdecode") and record.created >= self.since:
            self.records.append(record)

    def clear(self) -> None:
        self.records, self.since = [], time.time()

    def cause(self) -> tuple[str, str] | None:
        """(exception type and the innermost frame in specdecode, its traceback: the frames in
        specdecode, the innermost frame and the exception) of the first record, or None."""
        if not self.records:
            return None
        etype, exc, tb = self.records[0].exc_info
        frames = traceback.extract_tb(tb)
        ours = [f for f in frames if "/specdecode/" in f.filename] or frames[-1:]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
        shown = ours + frames[-1:] if frames and frames[-1] is not ours[-1] else ours
        text = "".join(traceback.format_list(shown) + traceback.format_exception_only(etype, exc))
        return f"{etype.__name__} at {where}", text[-4000:]


SANDBOX_RESTARTS: list = []  # in-process: the served engine's grammar compiler, to read its sandbox's restarts


@contextlib.contextmanager
def _in_process_server():
    import torch

    from test_server_harness import engine, serve

    torch.set_num_threads(1)  # as the tests' one_torch_thread fixture: tiny models gain nothing from more
    with serve(engine(k=3)) as s:
        SANDBOX_RESTARTS.append(s.scheduler.engine.grammars)
        yield s.url, F.KEY, F.MODEL


def _with_model(case: F.Case, model: str) -> F.Case:
    """The case aimed at a server that serves ``model`` (the strategies name the tiny server's)."""
    if model != F.MODEL and isinstance(case.value, dict) and case.value.get("model") == F.MODEL:
        return F.json_case(case.path, case.value | {"model": model})
    return case


def _kind(status: str, problem: str) -> str:
    """A violation without its values: ``status 307: ...`` -> ``307: status``; ``temperature 1e-40
    answered ...`` -> ``200: temperature # answered``."""
    head = " ".join(problem.split(":", 1)[0].split()[:3])
    return f"{status}: " + re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", head).replace("status #", "status")


STRATEGIES = {  # --strategies: which requests to generate
    "all": st.one_of(F.completion_cases, F.chat_cases, F.raw_cases, F.structured_cases),
    "api": st.one_of(F.completion_cases, F.chat_cases, F.raw_cases),
    "structured": F.structured_cases,  # schemas, regexes and grammars, hostile ones often (issue 59)
}


def fuzz(
    http: httpx.Client, examples: int, seed_: int, model: str, logs: _Tracebacks | None, strategy: str = "all"
) -> dict:
    statuses: collections.Counter[str] = collections.Counter()
    found: dict[str, dict] = {}
    started = time.monotonic()

    def record(case: F.Case, status: str, problems: list[str]) -> None:
        cause = logs.cause() if logs else None
        key = _kind(status, problems[0]) + (f" | {cause[0]}" if cause else "")
        entry = found.setdefault(key, {"cause": key, "count": 0, "body_bytes": len(case.body) + 1})
        entry["count"] += 1
        if len(case.body) < entry["body_bytes"]:  # keep the smallest example
            entry.update(
                status=status,
                body_bytes=len(case.body),
                request=case.shown(BODY_LIMIT),
                problem=problems[0][:1000],
                traceback=cause[1] if cause else None,
            )

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(seed_)
    @given(case=STRATEGIES[strategy])
    def run(case: F.Case) -> None:
        case = _with_model(case, model)
        if logs:
            logs.clear()
        try:
            response, problems = F.check(http, case)
            status = str(response.status_code)
        except httpx.TimeoutException:
            status, problems = "timeout", [f"timeout: no answer within {F.TIMEOUT_S:g} s (a hang?)"]
        except httpx.HTTPError as exc:
            status, problems = "transport", [f"transport error: {type(exc).__name__}: {exc}"]
        except Exception as exc:  # noqa: BLE001 - an answer too odd to check is a finding, not the end of the run
            status, problems = "unreadable", [f"unreadable answer: {type(exc).__name__}: {exc}"]
        statuses[status] += 1
        if problems:
            record(case, status, problems)
        done = sum(statuses.values())
        if done % 250 == 0:
            print(
                f"{done} examples, {len(found)} distinct violations, {time.monotonic() - started:.0f} s",
                file=sys.stderr,
            )

    run()
    return {
        "examples": sum(statuses.values()),
        "seed": seed_,
        "strategies": strategy,
        "seconds": round(time.monotonic() - started, 1),
        "statuses": dict(sorted(statuses.items())),
        "violations": sorted(found.values(), key=lambda e: e["cause"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--examples", type=int, default=10000, help="requests to generate (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    ap.add_argument("--out", type=Path, help="write the JSON summary here (else to stdout)")
    ap.add_argument("--endpoint", help="base URL of a running server (default: the tiny server, in-process)")
    ap.add_argument("--api-key", default="", help="its API key (with --endpoint)")
    ap.add_argument("--model", help="the model name it serves (with --endpoint)")
    ap.add_argument(
        "--strategies",
        choices=sorted(STRATEGIES),
        default="all",
        help="all (default); api: the request fields and raw bodies; structured: every request\n"
        "with a JSON schema, regex or grammar (deep $ref and rule chains, repetition\n"
        "blow-ups, unsatisfiable classes, never-ending grammars)",
    )
    args = ap.parse_args(argv)
    if args.endpoint and not args.model:
        ap.error("--endpoint needs --model")

    logs = None
    if args.endpoint:
        server = contextlib.nullcontext((args.endpoint.rstrip("/"), args.api_key, args.model))
    else:
        logs = _Tracebacks()
        server = _in_process_server()
    with server as (url, key, model), F.client(url, key) as http:
        if logs:  # once the server runs: uvicorn's logging setup replaces its loggers' handlers
            logging.getLogger().addHandler(logs)  # the server's records: into the summary, no more on stderr
            logging.getLogger("uvicorn.error").disabled = True  # repeats them on stderr
        before = F.greedy_probe(http)
        summary = fuzz(http, args.examples, args.seed, model, logs, args.strategies)
        summary["health_after"] = http.get("/health").status_code
        summary["greedy_probe_unchanged"] = F.greedy_probe(http) == before
        if SANDBOX_RESTARTS and SANDBOX_RESTARTS[0].sandbox is not None:
            summary["grammar_sandbox_restarts"] = SANDBOX_RESTARTS[0].sandbox.restarts
    text = json.dumps(summary, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    print(
        f"{summary['examples']} examples: {summary['statuses']}; {len(summary['violations'])} distinct violations",
        file=sys.stderr,
    )
    return 1 if summary["violations"] or not summary["greedy_probe_unchanged"] else 0


if __name__ == "__main__":
    sys.exit(main())
