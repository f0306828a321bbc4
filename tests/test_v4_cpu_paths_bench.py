"""benchmarks/v4_cpu_paths.py: every pair of V4 CPU paths (whole read against live read) gives
the same result before it is timed, and the table has a row per pair (times measure this
machine; none is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_table_has_every_pair_checked_equal(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "v4_cpu_paths.py"), "--repeats", "1",
         "--json", str(tmp_path / "paths.json")],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "paths.json").read_text())["rows"]
    assert [r["case"].split(",")[0] for r in rows] == [
        "indexer logits", "indexer logits", "sparse attention",
        "Triton indexer query (interpreter)" if not _gpu() else "Triton indexer query (compiled)",
    ]  # fmt: skip
    assert all(r["whole_ms"] > 0 and r["live_ms"] > 0 for r in rows)
    assert all(r["case"] in out.stdout for r in rows)


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()
