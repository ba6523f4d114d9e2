"""specdecode.allocator: glibc's malloc told to keep freed memory (a training-speed setting)."""

import subprocess
import sys

import pytest
from specdecode import allocator


class FakeLibc:
    def __init__(self, glibc=True):
        self.calls = []
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.36"

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


def test_the_three_knobs_are_set():
    libc = FakeLibc()
    assert allocator.retain_freed_memory(libc) is True
    assert libc.calls == [(-3, 32 << 20), (-1, (1 << 31) - 1), (-2, 512 << 20)]  # <malloc.h> M_MMAP/TRIM/TOP_PAD


def test_another_c_library_or_platform_is_left_alone(monkeypatch):
    libc = FakeLibc(glibc=False)
    assert allocator.retain_freed_memory(libc) is False and libc.calls == []
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.retain_freed_memory() is False


CHILD = """
import torch
from specdecode import allocator
assert allocator.retain_freed_memory() is True
for _ in range(3):  # blocks over the threshold are still allocated, written and freed correctly
    x = torch.ones(9 << 20)  # 36 MiB
    assert float(x.sum()) == 9 << 20
    del x
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_on_this_machine_glibc_takes_them_and_large_blocks_still_work():
    import ctypes

    try:
        glibc = hasattr(ctypes.CDLL("libc.so.6"), "gnu_get_libc_version")
    except OSError:
        glibc = False
    if not glibc:
        pytest.skip("not glibc")
    # in a child process: the setting lasts for the process, and the test session's should stay as it is
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
