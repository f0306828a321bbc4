"""scripts/gpu_recipe.py: pack here, run on a machine without SGLang, unpack the results.

The run is the GPU recipe on the CPU (--device cpu) at toy size, in a Python where `import
sglang` fails, as on the device machine: the real SmolLM2 GGUF is cut into parts, joined,
checked and converted; responses are regenerated, two arms trained on the same data and
steps, results split into parts and joined back into drafters our loaders accept.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_recipe.py"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_recipe


def _env(tmp: Path) -> dict:
    poison = tmp / "no-sglang"
    poison.mkdir(exist_ok=True)
    (poison / "sitecustomize.py").write_text("import sys\nsys.modules['sglang'] = None\n")
    return {**os.environ, "PYTHONPATH": str(poison), "OMP_NUM_THREADS": "2"}


def test_call_plan_fits_every_call_and_keeps_room_for_the_extras():
    mib = gpu_recipe.MIB
    ranges = gpu_recipe.plan_calls(98 * mib, 3 * mib, 25.0)
    assert ranges[0][0] == 0 and ranges[-1][1] == 98 * mib
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous
    assert all(b - a <= 25 * mib for a, b in ranges)
    assert ranges[-1][1] - ranges[-1][0] + 3 * mib <= 25 * mib  # last call: part + extras
    with pytest.raises(gpu_recipe.RecipeError, match="no room"):
        gpu_recipe.plan_calls(98 * mib, 30 * mib, 25.0)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-recipe")
    out = root / "bundle"
    rc = gpu_recipe.main(["pack", "--out", str(out), "--per-domain", "2",
                          "--prompt-seqs-per-domain", "3", "--no-download-wheels",
                          "--part-mib", "20"])  # fmt: skip
    assert rc == 0
    calls = sorted(out.glob("call-*"), key=lambda p: int(p.name.split("-")[1]))
    room = json.loads((calls[-1] / "manifest.json").read_text())["room_mib_per_call"]
    assert room == 20.0  # under what the tree leaves (64 MiB - the repository)
    gathered = root / "gathered"  # what the device commands do: cp -r call-N/. /tmp/gpu-bundle/
    gathered.mkdir()
    for c in calls:
        assert sum(p.stat().st_size for p in c.rglob("*") if p.is_file()) <= room * gpu_recipe.MIB
        shutil.copytree(c, gathered, dirs_exist_ok=True)
    return root, calls, gathered


@pytest.mark.slow
def test_pack_run_unpack_without_sglang(bundle, tmp_path):
    _, calls, gathered = bundle
    manifest = json.loads((calls[-1] / "manifest.json").read_text())
    assert len(calls) == len(manifest["gguf"]["parts"]) == 5  # 94 MiB of GGUF in 20 MiB calls
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(SCRIPT), "run", "--bundle", str(gathered), "--out", str(out),
           "--work", str(work), "--device", "cpu", "--arms", "dspark,mtp1", "--probe-steps", "2",
           "--steps", "3", "--global-batch-size", "2", "--micro-batch-size", "1",
           "--max-new-tokens", "4", "--gen-batch-size", "8", "--budget-s", "1800",
           "--checkpoint-every", "2", "--temperature", "0.7"]  # fmt: skip
    proc = subprocess.run(cmd, check=False, env=_env(tmp_path), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recipe = json.loads((out / "recipe.json").read_text())
    assert set(recipe["arms"]) == {"dspark", "mtp1"}
    for arm in ("dspark", "mtp1"):
        info = recipe["arms"][arm]
        assert info["steps"] == info["steps_planned"] == 3 and not info["time_boxed"]
        assert info["lm_head_positions"] > 0
    assert recipe["phases"]["data"]["sequences"] > 8 and recipe["phases"]["probe"]["steps"] == 3
    assert len(list(out.glob("results.tar.part-*"))) == recipe["results"]["parts"] >= 1

    runs = tmp_path / "runs"
    assert gpu_recipe.main(["unpack", "--parts", str(out), "--out", str(runs)]) == 0
    from sglang_dspark.drafter.checkpoint import load_draft, load_mtp_draft
    from sglang_dspark.drafter.target import load_target_config

    target = load_target_config(work / "SmolLM2-135M-Instruct-bfloat16")
    assert load_draft(runs / "dspark" / "draft", target_config=target) is not None
    assert load_mtp_draft(runs / "mtp1" / "draft", target_config=target) is not None
    summary = json.loads((runs / "data-summary.json").read_text())
    assert summary["sampling"]["temperature"] == 0.7

    # A cut part is caught by unpack, not extracted.
    part = out / "results.tar.part-0"
    part.write_bytes(part.read_bytes()[:-10])
    assert gpu_recipe.main(["unpack", "--parts", str(out), "--out", str(tmp_path / "x")]) == 2


def test_run_refuses_a_corrupt_or_missing_part(bundle, tmp_path):
    gathered = bundle[2]
    bad = tmp_path / "bad"
    shutil.copytree(gathered, bad)
    part = bad / "target.part-01"
    data = bytearray(part.read_bytes())
    data[1000] ^= 0xFF
    part.write_bytes(bytes(data))
    args = ["run", "--bundle", str(bad), "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          env=_env(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "a part is corrupt" in proc.stderr
    part.unlink()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          env=_env(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "target.part-01" in proc.stderr


def test_training_commands_need_no_sglang(tmp_path):
    """`sglang-dspark train` and `data build` import only their own modules: they run on a
    GPU training box that has no SGLang."""
    for cmd in (["train", "--help"], ["data", "build", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "sglang_dspark.cli", *cmd], check=False,
                              env=_env(tmp_path),
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0 and "usage: sglang-dspark" in proc.stdout, proc.stderr[-2000:]
