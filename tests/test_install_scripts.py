"""The backends' install scripts on their first-run path (download, patch, build, cache the wheel, install),
with every `python3` call answered by a stand-in on PATH, so the path CI takes after a build-flag or patch
change runs here in a second: the script must exit 0 and leave the wheel in the cache, and a failing build
must still fail. (A real build takes minutes; the cached-wheel path runs in every CI run.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# python3 as the scripts call it: `-m pip download|wheel|install`, a patch script, `-c` imports.
FAKE_PYTHON = r"""#!/usr/bin/env bash
set -eu
echo "$*" >>"$FAKE_LOG"
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ]; then
  case "$3" in
    download)
      dest=""; prev=""
      for a in "$@"; do [ "$prev" = "-d" ] && dest="$a"; prev="$a"; done
      src="$FAKE_TMP/src/$FAKE_NAME-$FAKE_VERSION"
      mkdir -p "$src/vendor/ik_llama.cpp/src" "$src/vendor/ik_llama.cpp/common" "$src/vendor/ik_llama.cpp/ggml/src/iqk/fa"
      echo '    auto max_cell = llama_kv_cache_cell_max(kv_self, pad);' >"$src/vendor/ik_llama.cpp/src/llama.cpp"
      for _ in 1 2 3 4; do echo '        for (; ik >=0 && Mc[ik] != 0; ik -= k_step);'; done \
        >"$src/vendor/ik_llama.cpp/ggml/src/iqk/fa/iqk_fa_templates.h"
      echo '' >"$src/vendor/ik_llama.cpp/common/build-info.cpp.in"
      tar -czf "$dest/$FAKE_NAME-$FAKE_VERSION.tar.gz" -C "$FAKE_TMP/src" "$FAKE_NAME-$FAKE_VERSION" ;;
    wheel)
      [ -z "${FAKE_BUILD_FAILS:-}" ] || exit 1
      out=""; prev=""
      for a in "$@"; do [ "$prev" = "-w" ] && out="$a"; prev="$a"; done
      mkdir -p "$out"; : >"$out/$FAKE_NAME-$FAKE_VERSION-py3-none-any.whl" ;;
    install) ;;
    *) exit 3 ;;
  esac
fi
exit 0
"""


def _run(script: str, name: str, version: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "src").mkdir(exist_ok=True)
    environ = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SPECDECODE_CACHE": str(tmp_path / "cache"),
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "FAKE_TMP": str(tmp_path),
        "FAKE_NAME": name,
        "FAKE_VERSION": version,
        **env,
    }
    # output to files, not pipes: the killed heartbeat's `sleep` would hold a pipe open for its 10 s
    with open(tmp_path / "out.log", "w") as out, open(tmp_path / "err.log", "w") as err:
        code = subprocess.run(
            ["bash", str(ROOT / "scripts" / script)], env=environ, stdout=out, stderr=err, timeout=120
        ).returncode
    return subprocess.CompletedProcess(
        [script], code, (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    )


def _pinned_llamacpp() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith('llamacpp = ["llama-cpp-python=='):
            return line.split("==")[1].split('"')[0]
    raise AssertionError("no llama-cpp-python pin in pyproject.toml")


@pytest.mark.parametrize(
    ("script", "name", "version"),
    [
        ("install-llamacpp.sh", "llama_cpp_python", _pinned_llamacpp()),
        ("install-ik-llamacpp.sh", "ik_llama_cpp_python", "0.1.5"),
    ],
)
def test_first_run_builds_caches_and_installs_the_wheel_with_exit_0(
    tmp_path: Path, script: str, name: str, version: str
) -> None:
    done = _run(script, name, version, tmp_path)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert "pip download" in calls and "pip wheel" in calls, calls  # the first-run path was taken
    wheels = list((tmp_path / "cache" / "wheels").glob(f"*/{name}-{version}-*.whl"))
    assert len(wheels) == 1, wheels
    assert "pip install --quiet --force-reinstall --no-deps" in calls and "-c import" in calls

    # the second run takes the cached wheel: no download, no build
    (tmp_path / "calls.log").unlink()
    again = _run(script, name, version, tmp_path)
    assert again.returncode == 0, again.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert "pip download" not in calls and "pip wheel" not in calls, calls


@pytest.mark.parametrize(
    ("script", "name"), [("install-llamacpp.sh", "llama_cpp_python"), ("install-ik-llamacpp.sh", "ik_llama_cpp_python")]
)
def test_a_failed_build_fails_the_script_and_caches_nothing(tmp_path: Path, script: str, name: str) -> None:
    version = _pinned_llamacpp() if script == "install-llamacpp.sh" else "0.1.5"
    done = _run(script, name, version, tmp_path, FAKE_BUILD_FAILS="1")
    assert done.returncode != 0
    assert not list((tmp_path / "cache").glob("wheels/*/*.whl"))
