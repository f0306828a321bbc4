"""kernels/benchmark.py runs without SGLang: on this CPU through Triton's interpreter at a
toy size (its times measure nothing; a GPU gives the real table), every kernel's row printed
with its bytes, ours against the torch reference, and SGLang's columns empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmark_table_without_sglang(tmp_path):
    poison = tmp_path / "no-sglang"
    poison.mkdir()
    (poison / "sitecustomize.py").write_text("import sys\nsys.modules['sglang'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(poison)}
    args = (
        [] if torch.cuda.is_available() else ["--requests", "2", "--context", "300", "--topk", "16"]
    )
    out = subprocess.run([sys.executable, str(REPO / "kernels" / "benchmark.py"), *args],
                         env=env, capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("(")]
    names = [r.split("  ")[0] for r in rows]
    assert len(rows) == 6 and any("KV norm+rope+fp8 store" in n for n in names), out.stdout
    for r in rows:
        cols = r[40:].split()
        assert float(cols[0]) > 0 and float(cols[1]) > 0  # MB moved, our microseconds
        assert cols[-2:] == ["-", "-"]  # no SGLang here
