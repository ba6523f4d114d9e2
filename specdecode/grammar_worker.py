"""The grammar sandbox: a child process that compiles a spec and computes its first mask before the
server trusts it (issue 59).

llguidance compiles grammars in native code. A spec can crash it (a long ``$ref`` or rule chain
overflows the native stack: a segfault, no traceback), exhaust its lexer's budget for seconds, or hold
hundreds of megabytes. :class:`GrammarSandbox` runs the compile and the first mask of every *new* spec
in a child process with

- a **time budget** (``time_budget_s`` of the child's CPU time: over it, the child is killed). CPU, not
  wall clock: the child is niced, so on a busy machine it may wait for a core far longer than it computes,
  and a legitimate spec must not be refused for that. A **wall-clock limit** (``wall_limit_s``, far
  longer) stops a child that neither answers nor computes. The child also sets its own CPU limit (the
  budget and a margin) for each job, so a spinning child whose server was killed ends by itself,
- a **memory budget** (``memory_budget_bytes`` of address space above what the child holds at rest:
  an allocation past it fails, which aborts the child),
- a **smaller native stack** than the server's threads (``STACK_BYTES``: the compile runs in a thread
  of that size, so a spec that compiles in the child compiles in any thread of the server, whose stacks
  are at least that large),

and answers the llguidance grammar text, or the reason it refused. A crash, a kill or an abort costs the
child, never the server: the next spec starts a fresh child. The child is niced, so its CPU goes after
the engine thread's.

The child imports llguidance and ``tokenizers`` only (no torch): it starts in a fraction of a second
plus llguidance's tokenizer build (seconds for a 150k-token vocabulary), once per child. Messages are
length-prefixed JSON over two pipes. Nothing here knows about HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdecode.extras import MissingExtra

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

try:
    import llguidance
except ModuleNotFoundError as exc:  # structured outputs are an extra
    raise MissingExtra("llguidance", "structured", "structured outputs") from exc

STACK_BYTES = 2 << 20  # the child's compile thread: a quarter of a Linux thread's default 8 MiB
STALL_S = 1.5  # the "stall" test fault: the child sleeps this long before compiling
READY_TIMEOUT_S = 300.0  # a child builds llguidance's tokenizer before its first job (not in any job's budget)
POLL_S = 0.05  # how often the parent reads the child's CPU time while a job runs
BOUNDED_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})"  # llama.cpp's JSON whitespace: one space, or 1-2 newlines + indent
# GrammarSpec.whitespace -> llguidance's JSON options (a schema's own "x-guidance" wins)
WHITESPACE: dict[str, JsonCompileOptions] = {
    "bounded": {"whitespace_pattern": BOUNDED_WHITESPACE},
    "flexible": {"whitespace_flexible": True},
    "compact": {"whitespace_flexible": False},
}


# --- what both sides build: the engine's grammar text, its tokenizer, its limits -----------------------


def llguidance_grammar(kind: str, text: str, whitespace: str | None = None) -> str:
    """The engine's grammar text for a spec (not yet validated); ValueError with the engine's words."""
    if kind == "json_schema":
        schema = json.loads(text)
        if isinstance(schema, bool):  # options apply to an object schema: true is {}, false stays unsatisfiable
            text, schema = ("{}", {}) if schema else (text, None)
        own = schema.get("x-guidance", {}) if isinstance(schema, dict) else {}
        options: JsonCompileOptions = (
            {}
            if schema is None or (isinstance(own, dict) and {"whitespace_pattern", "whitespace_flexible"} & set(own))
            else WHITESPACE[whitespace or "bounded"]
        )
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options or None)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("grammar", text)


def parser_limits(limits: dict[str, Any]) -> "llguidance.LLParserLimits":
    """llguidance's per-matcher limits (``GrammarLimits.parser``), with short error messages."""
    return llguidance.LLParserLimits(**limits, verbose_errors=False)


class _Tokens:
    """llguidance's TokenizerWrapper shape from each token's bytes (a tokenizer it cannot read from JSON);
    ``encode`` tokenizes text (None: greedy longest match over the tokens, enough for masks)."""

    def __init__(self, tokens: list[bytes], eos_id: int, bos_id: int | None, special: list[int], encode=None):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos_id, bos_id
        self.special_token_ids = special
        self._encode = encode
        self._ids = {t: i for i, t in enumerate(tokens) if t and i not in set(special)}
        self._longest = max((len(t) for t in self._ids), default=1)

    def __call__(self, text):
        if self._encode is not None:
            return self._encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
        data = text if isinstance(text, bytes) else text.encode()
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if data[i : i + n] in self._ids:
                    out.append(self._ids[data[i : i + n]])
                    i += n
                    break
            else:
                i += 1  # a byte no token spells: skipped
        return out


def build_ll_tokenizer(recipe: dict[str, Any], encode=None) -> "llguidance.LLTokenizer":
    """llguidance's tokenizer from a recipe: ``{"json": ...}`` (a fast tokenizer's JSON) or ``{"tokens": [hex]}``
    (each token's bytes), with ``n_vocab``, ``eos`` (and ``bos``, ``special`` for tokens)."""
    if "json" in recipe:
        return llguidance.LLTokenizer(recipe["json"], n_vocab=recipe["n_vocab"], eos_token=recipe["eos"])
    tokens = [bytes.fromhex(t) for t in recipe["tokens"]]
    wrapper = _Tokens(tokens, recipe["eos"], recipe.get("bos"), list(recipe.get("special", ())), encode)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(wrapper), n_vocab=recipe["n_vocab"], eos_token=recipe["eos"]
    )


def first_mask_problem(matcher: "llguidance.LLMatcher", end_ids: list[int], vocab_size: int) -> str:
    """Compute the first mask; "" if the spec can start an output, else why not (the engine's error, or
    a grammar this vocabulary cannot begin: no token but an end token allowed where the output is not
    yet complete)."""
    if matcher.is_error():
        return matcher.get_error()
    mask = bytearray(matcher.compute_bitmask())
    if matcher.is_error():
        return matcher.get_error()
    if matcher.is_accepting():
        return ""  # the empty output is complete: an end token may come first
    for t in end_ids:
        if t < vocab_size and t // 8 < len(mask):
            mask[t // 8] &= ~(1 << t % 8) & 0xFF
    tail = vocab_size % 8
    if tail and vocab_size // 8 < len(mask):
        mask[vocab_size // 8] &= (1 << tail) - 1
    if not any(mask[: (vocab_size + 7) // 8]):
        return "no token of this model's vocabulary can begin an output the grammar allows"
    return ""


def error_line(message: str) -> str:
    """The engine's message without its state dump, at most 500 characters."""
    message = message.split("\n<state>")[0].split("\n<non-verbose/>")[0].strip()
    if message in ("NoExtension", "NoExtensionBias"):  # llguidance's stop reason at the very start
        return f"nothing this model's vocabulary can spell satisfies it ({message})"
    return message if len(message) <= 500 else message[:497] + "..."


# --- the child ------------------------------------------------------------------------------------------


def _read_message(fd: int) -> Any:
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    body = _read_exactly(fd, struct.unpack("<I", head)[0])
    return None if body is None else json.loads(body)


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_message(fd: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    data = struct.pack("<I", len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def _heap_bytes() -> int:
    """Bytes the C heap holds now (glibc's mallinfo2: in use + mmapped); 0 where unknown."""
    try:
        import ctypes

        class _MallInfo2(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in (
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                )
            ]

        fn = ctypes.CDLL(None).mallinfo2
        fn.restype = _MallInfo2
        info = fn()
        return int(info.uordblks + info.hblkhd)
    except (AttributeError, OSError):
        return 0


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _job(tokenizer, job: dict[str, Any], end_ids: list[int], vocab_size: int) -> dict[str, Any]:
    fault = job.get("fault")
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "hang":  # a compile that computes on and on
        while True:
            pass
    if fault == "sleep":  # one that waits on and on
        time.sleep(3600)
    if fault == "stall":  # one that waits for the CPU on a busy machine, then compiles
        time.sleep(STALL_S)
    if fault == "memory":
        hog = [bytearray(64 << 20) for _ in range(1 << 12)]  # past any budget: MemoryError
        del hog
    try:
        grammar = llguidance_grammar(job["kind"], job["text"], job.get("whitespace"))
    except (ValueError, RecursionError) as e:
        return {"error": f"{e}"}
    before = _heap_bytes()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits(job["limits"]))
    problem = first_mask_problem(matcher, end_ids, vocab_size)
    if problem:
        return {"error": error_line(problem)}
    return {"grammar": grammar, "bytes": max(_heap_bytes() - before, 0) + len(grammar)}


def child_main(read_fd: int, write_fd: int) -> None:
    """The child's loop: a setup message (the tokenizer's recipe), then one job per message."""
    os.nice(10)
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash or a CPU limit leaves no core file
    setup = _read_message(read_fd)
    tokenizer = build_ll_tokenizer(setup["recipe"])
    end_ids, vocab_size, budget = setup["end_ids"], setup["recipe"]["n_vocab"], setup["memory_budget_bytes"]
    cpu_budget = setup.get("cpu_budget_s")
    _write_message(write_fd, {"ready": True})
    threading.stack_size(STACK_BYTES)
    while True:
        job = _read_message(read_fd)
        if job is None:
            return
        if budget:
            resource.setrlimit(resource.RLIMIT_AS, (_address_space() + budget, resource.RLIM_INFINITY))
        if cpu_budget:  # the parent kills at the budget; this SIGXCPU is for a child whose parent is gone
            usage = resource.getrusage(resource.RUSAGE_SELF)
            limit = int(usage.ru_utime + usage.ru_stime + cpu_budget) + 2
            resource.setrlimit(resource.RLIMIT_CPU, (limit, resource.RLIM_INFINITY))
        reply: dict[str, Any] = {}

        def run() -> None:
            try:
                reply.update(_job(tokenizer, job, end_ids, vocab_size))
            except MemoryError:
                reply["error"] = "memory"
            except Exception as e:  # an API misuse inside llguidance: the spec's problem all the same
                reply["error"] = error_line(f"{type(e).__name__}: {e}")

        worker = threading.Thread(target=run, name="grammar-compile")
        worker.start()
        worker.join()
        if budget:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        if cpu_budget:
            resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        if reply.get("error") == "memory":
            os._exit(3)  # the heap may be in pieces: the parent says "memory budget" and starts a new child
        _write_message(write_fd, reply)


# --- the parent -----------------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used (user + system, /proc), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _reap(proc: subprocess.Popen, fds: tuple[int, ...]) -> None:
    """Kill and reap a child, close its pipes (also what a dropped sandbox's finalizer does)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SandboxClosed(RuntimeError):
    """The sandbox was closed (the server is shutting down): no spec is checked."""


class SandboxRefused(Exception):
    """The child refused a spec: ``str(e)`` is why (the engine's words, or the budget it exceeded)."""


@dataclass(frozen=True)
class Approved:
    grammar: str  # llguidance's grammar text, validated
    bytes: int  # estimate: the C heap the compile and first mask took in the child, plus the text


class GrammarSandbox:
    """One child process at a time, restarted after any death; thread-safe (jobs queue on a lock). After
    :meth:`close`, :meth:`check` raises SandboxClosed (it starts no child) until :meth:`start` opens it again;
    a sandbox that is garbage-collected takes its child with it.

    ``recipe``: how the child builds the tokenizer (:func:`build_ll_tokenizer`); ``end_ids`` and the
    vocabulary size decide "can this vocabulary begin the output". ``limits``: llguidance's parser limits
    (a dict of :class:`llguidance.LLParserLimits` fields). ``fault_marker`` is for tests: a spec whose text
    contains ``fault_marker + ":crash"`` (``:hang``, ``:sleep``, ``:stall``, ``:memory``) makes the child
    segfault (spin, sleep for good, sleep ``STALL_S`` then compile, allocate past the budget), so a test can
    see what each costs."""

    def __init__(
        self,
        recipe: dict[str, Any],
        end_ids,
        limits: dict[str, Any],
        *,
        time_budget_s: float,
        memory_budget_bytes: int,
        max_matcher_bytes: int,
        wall_limit_s: float = 60.0,
        fault_marker: str | None = None,
    ):
        self._setup = {
            "recipe": recipe,
            "end_ids": sorted(end_ids),
            "memory_budget_bytes": memory_budget_bytes,
            "cpu_budget_s": time_budget_s,
        }
        self.limits = dict(limits)
        self.time_budget_s = time_budget_s
        self.wall_limit_s = wall_limit_s
        self.memory_budget_bytes = memory_budget_bytes
        self.max_matcher_bytes = max_matcher_bytes
        self.fault_marker = fault_marker
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._fds: tuple[int, int] | None = None  # (read from the child, write to the child)
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        self.restarts = 0  # children started after the first (each one a crash, kill or abort)

    def _start(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        code = f"import sys; from specdecode.grammar_worker import child_main; child_main({to_child_r}, {from_child_w})"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, close_fds=True
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._fds = (from_child_r, to_child_w)
        self._finalizer = weakref.finalize(self, _reap, self._proc, self._fds)
        try:
            _write_message(to_child_w, self._setup)
        except OSError:
            pass  # it died: the wait below says so
        if self._wait(READY_TIMEOUT_S) is None:
            self._stop()
            raise RuntimeError("the grammar sandbox did not start")

    def _child(self) -> tuple[subprocess.Popen, tuple[int, int]]:
        """The running child and its pipes (read from it, write to it); only while one runs."""
        assert self._proc is not None and self._fds is not None, "no sandbox child is running"
        return self._proc, self._fds

    def _wait(self, timeout_s: float) -> Any:
        """The child's next message, or None if it died (then it is reaped) or said nothing within
        ``timeout_s`` (then it still runs)."""
        proc, (fd, _) = self._child()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return None
        try:
            message = _read_message(fd)
        except (OSError, ValueError):
            message = None
        if message is None:  # the pipe closed: the child is gone or going
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10.0)
        return message

    def _job_reply(self) -> tuple[Any, str]:
        """The child's reply to the job just sent, or (None, why not): "died" (it is reaped), "cpu" (it
        used more than the time budget of CPU) or "wall" (no answer within the wall-clock limit); then it
        still runs. Without /proc, the time budget is wall clock."""
        proc, (fd, _) = self._child()
        pid = proc.pid
        start = _cpu_seconds(pid)
        limit = self.wall_limit_s if start is not None else min(self.time_budget_s, self.wall_limit_s)
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, "wall" if start is not None else "cpu"
            ready, _, _ = select.select([fd], [], [], min(POLL_S, left) if start is not None else left)
            if ready:
                message = self._wait(0)
                return message, "died"
            used = _cpu_seconds(pid) if start is not None else None
            if start is not None and used is not None and used - start > self.time_budget_s:
                return None, "cpu"

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._proc is not None:
            _reap(self._proc, self._fds or ())
        self._proc, self._fds, self._finalizer = None, None, None

    def _ensure(self) -> None:
        """A live child (lock held): a dead one is replaced; none once closed."""
        if self._closed:
            raise SandboxClosed("the grammar sandbox is closed")
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:
            self._stop()
            self.restarts += 1
        self._start()

    def start(self) -> None:
        """Start the child now (it builds the tokenizer), rather than on the first spec."""
        with self._lock:
            self._closed = False
            self._ensure()

    def close(self) -> None:
        """Stop the child now (a job it runs ends in SandboxClosed); :meth:`check` starts none until
        :meth:`start`."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()  # without the lock: a job in flight must not hold the shutdown up
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def check(self, kind: str, text: str, whitespace: str | None) -> Approved:
        """Compile ``(kind, text)`` and compute its first mask in the child: the approved grammar text, or
        SandboxRefused with why."""
        job: dict[str, Any] = {"kind": kind, "text": text, "whitespace": whitespace, "limits": self.limits}
        if self.fault_marker:
            for fault in ("crash", "hang", "sleep", "stall", "memory"):
                if f"{self.fault_marker}:{fault}" in text:
                    job["fault"] = fault
        with self._lock:
            self._ensure()
            try:
                _write_message(self._child()[1][1], job)
                reply, why = self._job_reply()
            except OSError:
                reply, why = None, "died"
            if reply is None and self._closed:
                self._stop()
                raise SandboxClosed("the grammar sandbox was closed")
            if reply is None:
                proc = self._child()[0]
                if why == "died" and proc.poll() is None:  # it closed its pipe, then did not exit
                    why = "wall"
                code = proc.poll()
                self._stop()
                self.restarts += 1
                if why == "cpu" or code == -signal.SIGXCPU:
                    raise SandboxRefused(
                        f"compiling it and computing its first mask took more than the time "
                        f"budget (grammar_time_budget_s = {self.time_budget_s:g} s of CPU)"
                    )
                if why == "wall":
                    raise SandboxRefused(
                        f"compiling it and computing its first mask did not finish within the "
                        f"wall-clock limit (grammar_wall_limit_s = {self.wall_limit_s:g})"
                    )
                if code == 3 or code == -signal.SIGABRT:
                    raise SandboxRefused(
                        f"compiling it exceeded the memory budget (grammar_memory_budget_bytes "
                        f"= {self.memory_budget_bytes})"
                    )
                how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
                raise SandboxRefused(f"the grammar compiler crashed on it ({how}); shorten its $ref or rule chains")
        if "error" in reply:
            raise SandboxRefused(reply["error"])
        if reply["bytes"] > self.max_matcher_bytes:
            raise SandboxRefused(
                f"its compiled form takes about {reply['bytes']} bytes, more than the limit "
                f"max_matcher_bytes = {self.max_matcher_bytes}"
            )
        return Approved(reply["grammar"], int(reply["bytes"]))
