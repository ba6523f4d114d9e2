"""The backend registry: a backend is one file plus one registry line, and generate, check and serve
drive it like any other (the toy backend, and a copy registered at run time); `--backend auto` says
what it chose and why; refusals name the setting."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from specdecode.cli import main
from specdecode.models import backends
from specdecode.models.backends import BackendRefused, Request


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


GREEDY = ["--prompt", "abcabcab", "--max-new-tokens", "24", "--ignore-eos", "--json"]


def test_generate_drives_the_toy_backend_and_speculation_keeps_the_greedy_output(capsys):
    code, base, err = run(capsys, "generate", "--backend", "toy", "--target", "toy:3", *GREEDY)
    assert code == 0, err
    code, spec, err = run(
        capsys, "generate", "--backend", "toy", "--target", "toy:3", "--draft", "toy:3:0.2", "-k", "3", *GREEDY
    )
    assert code == 0, err
    base, spec = json.loads(base), json.loads(spec)
    assert spec["backend"] == "toy" and spec["where"] == {"target": "toy cpu float32", "draft": "toy cpu float32"}
    assert spec["stats"]["drafted"] > 0 and spec["stats"]["accepted"] > 0  # speculation was exercised
    assert spec["token_ids"] == base["token_ids"] and len(base["token_ids"]) == 24


def test_a_backend_registered_at_run_time_is_one_line(capsys, monkeypatch):
    """What adding a backend takes: its module (here the toy's, under another name) and one registry line."""
    monkeypatch.setitem(backends.BACKENDS, "toy2", "specdecode.models.backends.toy")
    code, out, err = run(capsys, "generate", "--backend", "toy2", "--target", "toy:1", "--draft", "ngram", *GREEDY)
    assert code == 0, err
    code, ref, err = run(capsys, "generate", "--backend", "toy", "--target", "toy:1", *GREEDY)
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--backend", "nosuch", "--target", "toy:1", "--prompt", "a"])
    assert exit_.value.code == 2 and "toy2" in capsys.readouterr().err  # the flag lists what is registered now


@pytest.mark.parametrize("flag, expected", [([], "resident"), (["--weights", "mapped"], "mapped")])
def test_the_weights_flag_reaches_every_model_load(capsys, monkeypatch, flag, expected):
    from specdecode.models.backends import toy

    seen = []
    load = toy.BACKEND.load
    monkeypatch.setattr(
        toy.BACKEND,
        "load",
        lambda spec, settings: seen.append((settings.role, settings.weights)) or load(spec, settings),
    )
    code, out, err = run(
        capsys, "generate", "--backend", "toy", "--target", "toy:3", "--draft", "toy:3:0.2", *flag, *GREEDY
    )
    assert code == 0, err
    assert seen == [("target", expected), ("draft", expected)]


def test_check_passes_on_the_toy_backend(capsys, tmp_path):
    code, out, err = run(
        capsys,
        "check",
        "--backend",
        "toy",
        "--target",
        "toy:2",
        "--draft",
        "toy:2:0.3",
        "-k",
        "3",
        "--num-prompts",
        "2",
        "--law-samples",
        "2000",
        "--law-contexts",
        "2",
        "--e2e-samples",
        "200",
        "--e2e-batch",
        "50",
        "--greedy-tokens",
        "12",
        "--no-progress",
        "--json",
        str(tmp_path / "c.json"),
    )
    report = json.loads((tmp_path / "c.json").read_text())
    assert code == 0, out + err
    assert report["meta"]["backend"] == "toy" and [p["status"] for p in report["parts"]] == ["PASS"] * 5


def test_serve_drives_the_toy_backend(capsys, monkeypatch):
    """`specdecode serve --backend toy` builds its app the way it does for any backend; greedy completions
    through it equal `generate`'s target-only output."""
    from specdecode.server import cli as server_cli
    from specdecode.server.connections import DrainingServer, uvicorn_config

    apps = []
    monkeypatch.setattr(server_cli, "run_server", lambda app, *a, **k: apps.append(app))
    code, _, err = run(
        capsys,
        "serve",
        "--backend",
        "toy",
        "--target",
        "toy:4",
        "--draft",
        "toy:4:0.2",
        "-k",
        "3",
        "--max-batch-size",
        "2",
    )
    assert code == 0 and len(apps) == 1, err
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = DrainingServer(uvicorn_config(apps[0], log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)

    async def complete(prompts):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=300) as client:
            replies = await asyncio.gather(
                *[
                    client.post(
                        "/v1/completions",
                        json={"model": "toy:4", "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                    )
                    for p in prompts
                ]
            )
            metrics = (await client.get("/metrics")).text
        return [r.json() for r in replies], metrics

    try:
        replies, metrics = asyncio.run(complete(["abcab", "xyzxyz"]))
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    for prompt, reply in zip(["abcab", "xyzxyz"], replies):
        code, ref, err = run(
            capsys,
            "generate",
            "--backend",
            "toy",
            "--target",
            "toy:4",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--json",
        )
        assert reply["choices"][0]["text"] == json.loads(ref)["text"], reply
    drafted = [line for line in metrics.splitlines() if line.startswith("specdecode_spec_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0  # speculation was exercised


def test_auto_says_what_it_chose_and_why_on_one_line(capsys, tmp_path, monkeypatch):
    from gguf_util import write_tiny_qwen2_gguf
    from specdecode.models import llamacpp

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(gguf)
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    code, out, err = run(capsys, "generate", "--target", str(gguf), "--prompt", "ab", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("backend:")]
    assert len(lines) == 1 and lines[0].startswith("backend: torch (not llamacpp:") and "install-llamacpp" in lines[0]
    code, out, err = run(
        capsys, "generate", "--backend", "torch", "--target", str(gguf), "--prompt", "ab", "--max-new-tokens", "2"
    )
    assert code == 0 and "backend:" not in err  # asked for by name: nothing to explain


def test_refusals_name_the_setting_and_auto_skips_what_cannot_serve(tmp_path, monkeypatch):
    toy = backends.get("toy")
    assert toy.refuses(Request("toy:1")) is None
    why = toy.refuses(
        Request(
            "toy:1",
            device="cuda",
            dtype="bfloat16",
            target_quantization="int8",
            draft_modes=frozenset({"int8"}),
            batch_invariant="on",
            features=True,
        )
    )
    for setting in (
        "cuda",
        "--dtype",
        "--target-quantization int8",
        "--draft-quantization int8",
        "--batch-invariant",
        "EAGLE",
    ):
        assert setting in why, (setting, why)
    with pytest.raises(BackendRefused, match="--dtype"):
        backends.choose("toy", Request("toy:1", dtype="float32"))
    with pytest.raises(BackendRefused, match="auto or one of"):
        backends.get("onnx")
    assert not backends.get("toy").supports.auto  # a demo backend is never chosen behind the user's back


def test_minus_k_0_with_a_draft_does_not_load_it(capsys):
    code, out, err = run(
        capsys, "generate", "--backend", "toy", "--target", "toy:3", "--draft", "toy:3:0.2", "-k", "0", *GREEDY
    )
    assert code == 0 and "-k 0" in err and "not loaded" in err
    result = json.loads(out)
    assert result["where"] == {"target": "toy cpu float32"} and result["stats"]["drafted"] == 0


def test_no_isinstance_on_model_classes_outside_the_backends():
    """The engine, drafters and tools reach models only through a backend and the runner protocol."""
    import re
    from pathlib import Path

    import specdecode

    root = Path(specdecode.__file__).parent
    own = {"models/hf.py", "models/quantize.py", "models/batch_invariant.py", "heads"}  # the torch backend's files
    pattern = re.compile(r"isinstance\([^)]*(nn\.Module|LlamaCpp\w*|PreTrainedModel)")
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if not str(path.relative_to(root)).startswith("models/backends/")
        and not any(str(path.relative_to(root)).startswith(o) for o in own)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
