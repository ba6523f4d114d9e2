"""scripts/patch_llamacpp.py: the AMX tile-configuration patch applied before llama.cpp is built."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("patch_llamacpp", ROOT / "scripts" / "patch_llamacpp.py")
patch_llamacpp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patch_llamacpp)

UPSTREAM = """inline void ggml_tile_config_init(void) {
    static thread_local bool done = false;

    if (done) {
        return;
    }

    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.rows[0] = 8;   tc.colsb[0] = 64;

    _tile_loadconfig(&tc);
    done = true;
}
"""


def tree(tmp_path: Path, text: str) -> Path:
    mmq = tmp_path / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
    mmq.parent.mkdir(parents=True)
    mmq.write_text(text)
    return tmp_path


def test_the_barrier_goes_right_before_the_load_and_a_second_run_changes_nothing(tmp_path):
    root = tree(tmp_path, UPSTREAM)
    assert patch_llamacpp.patch(root) == "patched"
    text = (root / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp").read_text()
    lines = text.splitlines()
    load = lines.index("    _tile_loadconfig(&tc);")
    assert lines[load - 1] == '    __asm__ __volatile__("" : : "r"(&tc) : "memory");'
    assert text.count("_tile_loadconfig") == 1 and "tc.rows[0] = 8;" in text  # nothing else touched
    assert "return;" not in text  # the configuration is loaded on every call, not once per thread
    assert patch_llamacpp.patch(root) == "already patched"
    assert (root / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp").read_text() == text


def test_a_source_that_moved_on_or_a_wrong_directory_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        patch_llamacpp.patch(tmp_path)
    root = tree(tmp_path, UPSTREAM.replace("_tile_loadconfig(&tc);", "_tile_loadconfig(&kTileConfig);"))
    with pytest.raises(SystemExit, match="no longer holds"):
        patch_llamacpp.patch(root)


def test_the_install_script_patches_before_it_builds():
    script = (ROOT / "scripts" / "install-llamacpp.sh").read_text()
    assert script.index("patch_llamacpp.py") < script.index("pip wheel")
    assert "patch_llamacpp.py" in (ROOT / "scripts" / "build-llamacpp-tools.sh").read_text()
