"""Every command line in README.md runs as written, against tiny models.

The lines are read from the README's ``bash`` blocks, split at ``&&``, and run in this process through
the same ``main`` the ``specdecode`` script calls. What cannot run here is replaced, and only that:

* ``pip install ...``, ``scripts/install-llamacpp.sh`` and the test command itself are the CI's own steps;
* ``specdecode models fetch qwen2.5-coder`` downloads ~1.5 GB: instead the aliases it registers
  (``qwen2.5-coder-1.5b``, ``qwen2.5-coder-0.5b``) name tiny GGUF files written here;
* the placeholders ``T`` (target), ``D`` / ``D.gguf`` (draft), ``F`` (features), ``H`` / ``E`` (trained
  heads), ``SMALL`` (a draft read through its own tokenizer) name files in a temporary directory;
* ``serve`` answers on a free port in a thread rather than forever on 8000, and the ``load`` line after
  it is pointed at that port;
* ``--device cuda`` on a machine without CUDA must fail the way a user sees it: one line, exit 2;
* the lines that need the llama.cpp backend (:func:`needs_llamacpp`) run in their own test, marked
  ``llamacpp`` and skipped with the reason where llama-cpp-python is not installed (the README's test
  command on a fresh checkout); there, each of them must fail the way a user sees it: one line naming
  ``scripts/install-llamacpp.sh``, exit 2.
"""

from __future__ import annotations

import re
import shlex
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from specdecode.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
SKIPPED = ("pip install", "scripts/install-llamacpp.sh", "python -m pytest", "specdecode models fetch")


def needs_llamacpp(command: str) -> bool:
    """A README line that runs a model on llama.cpp whatever else is installed: ``--backend llamacpp``, or a
    ``.gguf`` draft kept in its quantization (``@gguf|@q8_0|@q4_0``, ``--draft-quantization gguf``)."""
    return (
        "--backend llamacpp" in command
        or re.search(r"@(gguf|q8_0|q4_0)\b", command) is not None
        or "--draft-quantization gguf" in command
    )


def llamacpp_installed() -> bool:
    from specdecode.models import llamacpp

    return llamacpp.available()


def readme_commands() -> list[str]:
    """Each command of the README's bash blocks (comments dropped, ``&&`` chains split), in order."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def test_the_readme_names_what_it_runs():
    commands = readme_commands()
    assert sum(c.startswith("specdecode ") for c in commands) >= 20
    assert any(c.startswith("pip install -e . ") or c == "pip install -e ." for c in commands)
    assert any("pytest" in c for c in commands)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from gguf_util import write_tiny_qwen2_gguf
    from specdecode.models import fetch

    root = tmp_path_factory.mktemp("readme")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDECODE_CACHE", str(root / "cache"))
    target, draft = root / "target.gguf", root / "draft.gguf"
    write_tiny_qwen2_gguf(target, seed=0)
    write_tiny_qwen2_gguf(draft, seed=1)  # another tiny model over the same vocabulary
    fetch.register_model("qwen2.5-coder-1.5b", target)
    fetch.register_model("qwen2.5-coder-0.5b", draft)
    fetch.register_pair("qwen2.5-coder", draft="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b")
    names = {
        "T": str(target),
        "D": str(draft),
        "D.gguf": str(draft),
        "F": str(root / "features"),
        "H": str(root / "medusa"),
        "E": str(root / "eagle"),
        "SMALL": str(draft),
    }  # xvocab:SMALL reads text: any tokenizer, this one included
    yield names
    mp.undo()


def _ansi_c(command: str) -> str:
    """bash's ``$'...'`` quoting (``\\n`` is a newline there), which shlex does not know, as plain quoting."""
    return re.sub(
        r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(m.group(1).encode().decode("unicode_escape")), command
    )


def _argv(command: str, names: dict[str, str]) -> list[str]:
    words = shlex.split(_ansi_c(command))
    assert words[0] == "specdecode", command
    out = []
    for word in words[1:]:
        base, at, mode = word.partition("@")
        if ":" in base and base.split(":", 1)[1] in names:  # medusa:H, eagle:E
            kind, name = base.split(":", 1)
            word = f"{kind}:{names[name]}"
        elif base in names:
            word = names[base] + at + mode
        out.append(word)
    return out


def _quick(argv: list[str]) -> list[str]:
    """The heads extract line reads fewer tokens of the corpus than a real run's default."""
    if argv[:2] == ["heads", "extract"]:
        return argv + ["--max-tokens", "3000", "--seq-len", "64"]
    return argv


def _run_readme(world, capsys, monkeypatch, selected) -> tuple[list[str], list[str], int]:
    """Run the README's commands that ``selected(command)`` picks: (commands run, failures, servers started).
    A command that ``expect_missing_llamacpp`` picks must fail as a user without llama.cpp sees it."""
    from specdecode.server import cli as server_cli
    from specdecode.server.connections import DrainingServer, uvicorn_config

    servers = []

    def serve_in_a_thread(app, host, port, *args, **kwargs):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = DrainingServer(uvicorn_config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        servers.append((server, thread, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"))

    monkeypatch.setattr(server_cli, "run_server", serve_in_a_thread)
    failures, ran = [], []
    missing = not llamacpp_installed()
    try:
        for command in readme_commands():
            if command.startswith(SKIPPED) or not command.startswith("specdecode") or not selected(command):
                continue
            ran.append(command)
            argv = _quick(_argv(command, world))
            if argv[0] == "load" and servers:
                argv = [servers[-1][3] if a == "http://127.0.0.1:8000" else a for a in argv]
                argv += ["--num-requests", "4", "--output-len", "8"]
            try:
                code = main(argv)
            except SystemExit as exc:  # --help
                code = exc.code
            out = capsys.readouterr()
            if "--device" in argv and "cuda" in argv and not torch.cuda.is_available():
                if code != 2 or len(out.err.strip().splitlines()) != 1 or "Traceback" in out.err:
                    failures.append(f"{command}: without CUDA expected one line and exit 2, got {code}: {out.err}")
                continue
            if missing and needs_llamacpp(command):
                if code != 2 or "scripts/install-llamacpp.sh" not in out.err or "Traceback" in out.err:
                    failures.append(
                        f"{command}: without llama.cpp expected exit 2 naming scripts/install-llamacpp.sh,"
                        f" got {code}: {out.err[-2000:]}"
                    )
                continue
            if code != 0:
                failures.append(f"{command}: exit {code}: {out.err[-2000:]}")
    finally:
        for server, thread, sock, _ in servers:
            server.should_exit = True
            thread.join(30)
            sock.close()
    return ran, failures, len(servers)


def test_every_readme_command_runs_as_written(world, capsys, monkeypatch):
    """Every line that runs without llama.cpp; where it is not installed, the lines that need it fail
    the way a user sees it (one line naming the install script, exit 2)."""
    missing = not llamacpp_installed()
    ran, failures, servers = _run_readme(world, capsys, monkeypatch, lambda c: missing or not needs_llamacpp(c))
    assert not failures, "\n\n".join(failures)
    assert len(ran) >= 20 and any(c.startswith("specdecode load") for c in ran) and servers, ran


@pytest.mark.llamacpp
def test_readme_llamacpp_commands_run_as_written(world, capsys, monkeypatch):
    """The README lines that need the llama.cpp backend, run on it."""
    pytest.importorskip("llama_cpp", reason="the llama.cpp backend is not installed (scripts/install-llamacpp.sh)")
    ran, failures, _ = _run_readme(world, capsys, monkeypatch, needs_llamacpp)
    assert not failures, "\n\n".join(failures)
    assert len(ran) >= 2, ran


def test_the_readme_lines_that_need_llamacpp_are_the_ones_named():
    """The split above is by what the lines say: the install line's generate, and the GGUF draft kept quantized."""
    named = [c for c in readme_commands() if needs_llamacpp(c)]
    assert any("--backend llamacpp" in c for c in named) and any("@q4_0" in c for c in named), named
    assert not any(
        c.startswith("specdecode generate --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --num-draft-tokens")
        for c in named
    )  # the main job runs anywhere
