"""`sglang-dspark patches check|apply` on a clean, a patched and a foreign sglang tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dspark.serving import patching


def _patched_files() -> list[str]:
    files = []
    for patch in patching.patch_files():
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                files.append(line[6:].strip())
    return files


@pytest.fixture
def clean_tree(tmp_path) -> Path:
    """A copy of the files our patches touch, as shipped in sglang==0.5.23."""
    root = patching.sglang_root()
    for rel in _patched_files():
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, dst)
    patching.revert(tmp_path)  # the installed tree may already be patched
    return tmp_path


def _states(root: Path) -> set[str]:
    return {s.state.value for s in patching.status(root)}


def test_clean_tree_reports_not_applied(clean_tree):
    assert _states(clean_tree) == {"not applied"}


def test_apply_then_check_reports_applied_and_is_idempotent(clean_tree):
    first = patching.apply(clean_tree)
    assert {s.state.value for s in first} == {"applied"}
    snapshot = {p: p.read_bytes() for p in clean_tree.rglob("*.py")}
    patching.apply(clean_tree)
    assert {p: p.read_bytes() for p in clean_tree.rglob("*.py")} == snapshot
    assert "sglang-dspark 0001" in (clean_tree / _patched_files()[0]).read_text()


def test_foreign_tree_reports_does_not_apply_and_apply_refuses(clean_tree):
    target = clean_tree / _patched_files()[0]
    target.write_text(target.read_text().replace("if _is_cpu:", "if _is_cpu and False:"))
    assert "does not apply" in _states(clean_tree)
    before = target.read_text()
    with pytest.raises(RuntimeError, match="not a clean sglang==0.5.23"):
        patching.apply(clean_tree)
    assert target.read_text() == before  # nothing changed


def test_installed_sglang_is_patched_and_cli_says_so():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_dspark.cli", "patches", "check"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0001-cpu-tolerate-missing-sgl-kernel-ops.patch: applied" in proc.stdout
