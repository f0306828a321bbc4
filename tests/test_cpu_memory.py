"""The CPU scheduler's heap trimming (sglang_dspark/plugin/cpu_memory.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sglang_dspark.plugin import cpu_memory

# A fragmented glibc heap: 200 x 1 MiB blocks from the heap (mmap threshold raised), all freed
# but the last one, which pins the heap's top so that free() cannot shrink it by itself.
FRAGMENT = textwrap.dedent(
    """
    import ctypes, sys, time
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 1 MiB blocks come from the heap
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
    blocks = [libc.malloc(1 << 20) for _ in range(200)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks[:-1]:
        libc.free(b)
    before = rss()
    sys.path.insert(0, sys.argv[1])
    from sglang_dspark.plugin import cpu_memory
    if sys.argv[2] == "trim":
        cpu_memory.start_trimmer(0.05)
    time.sleep(0.5)
    print(before, rss())
    """
)


@pytest.mark.parametrize("mode", ["trim", "none"])
def test_the_trimmer_gives_a_fragmented_heap_back(mode, tmp_path):
    script = tmp_path / "fragment.py"
    script.write_text(FRAGMENT)
    repo = str(__import__("pathlib").Path(cpu_memory.__file__).parents[2])
    out = subprocess.run([sys.executable, str(script), repo, mode], capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    before, after = int(out[0]), int(out[1])
    if mode == "trim":
        assert before - after > 150, (before, after)  # about 199 MiB returned
    else:
        assert before - after < 20, (before, after)  # the control: nothing returned by itself


def test_period_from_the_environment():
    assert cpu_memory.trim_period({}) == cpu_memory.DEFAULT_PERIOD_S
    assert cpu_memory.trim_period({cpu_memory.PERIOD_ENV: "0"}) == 0
    assert cpu_memory.trim_period({cpu_memory.PERIOD_ENV: "2.5"}) == 2.5
    for bad in ("-1", "often"):
        with pytest.raises(ValueError, match="seconds >= 0"):
            cpu_memory.trim_period({cpu_memory.PERIOD_ENV: bad})
    assert cpu_memory.start_trimmer(0) is None


def test_one_trimmer_per_process():
    first = cpu_memory.start_trimmer(30)
    try:
        assert first is not None and first.daemon
        assert cpu_memory.start_trimmer(30) is first
    finally:
        first.stop.set()
        first.join(5)
