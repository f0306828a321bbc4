"""recipes/gpu_recipe.py: pack here, run on a machine without SGLang, unpack the results.

The run is the GPU recipe on the CPU (--device cpu) at toy size, in a Python where `import
sglang` fails, as on the device machine: the bundle (the real SmolLM2 GGUF and a drafter to
start from) is cut into parts, joined, checked and converted; two arms train on the in-tree
data at equal steps, each from its starting drafter, with held-out curves; results are split
into parts and joined back into drafters our loaders accept.
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
SCRIPT = REPO / "recipes" / "gpu_recipe.py"
sys.path.insert(0, str(REPO / "recipes"))

import gpu_recipe


def _env(tmp: Path) -> dict:
    poison = tmp / "no-sglang"
    poison.mkdir(exist_ok=True)
    (poison / "sitecustomize.py").write_text("import sys\nsys.modules['sglang'] = None\n")
    return {**os.environ, "PYTHONPATH": str(poison), "OMP_NUM_THREADS": "2"}


def test_call_plan_cuts_the_bundle_into_calls_that_fit():
    mib = gpu_recipe.MIB
    ranges = gpu_recipe.plan_calls(98 * mib, 25.0)
    assert ranges[0][0] == 0 and ranges[-1][1] == 98 * mib and len(ranges) == 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous
    assert all(b - a <= 25 * mib for a, b in ranges)
    with pytest.raises(gpu_recipe.RecipeError, match="no room"):
        gpu_recipe.plan_calls(98 * mib, -1.0)
    with pytest.raises(gpu_recipe.RecipeError, match="ARM=DIR"):
        gpu_recipe.parse_init(["nonsense=/tmp"])
    with pytest.raises(gpu_recipe.RecipeError, match="not a drafter directory"):
        gpu_recipe.parse_init([f"dspark={REPO}"])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-recipe")
    out = root / "bundle"
    rc = gpu_recipe.main(["pack", "--out", str(out), "--no-download-wheels", "--part-mib", "20",
                          "--init", f"mtp1={REPO / 'sglang_dspark/assets/smollm2-mtp1'}"])  # fmt: skip
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
    parts = manifest["bundle"]["parts"]
    assert len(calls) == len(parts) == -(-manifest["bundle"]["bytes"] // (20 * gpu_recipe.MIB))
    assert manifest["bundle"]["bytes"] > manifest["gguf"]["bytes"] + 7 * gpu_recipe.MIB  # + MTP-1
    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join((REPO / gpu_recipe.HELDOUT / "heldout-t1.jsonl").open().readlines()[:3])
    )
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(SCRIPT), "run", "--bundle", str(gathered), "--out", str(out),
           "--work", str(work), "--device", "cpu", "--arms", "dspark,mtp1", "--probe-steps", "2",
           "--steps", "3", "--global-batch-size", "2", "--micro-batch-size", "2",
           "--budget-s", "1800", "--checkpoint-every", "2", "--eval-data", str(held),
           "--eval-every", "2", "--feature-cache-gb", "0.5",
           # cache groups of 2 (a group of 32 computes 32 sequences' features to train on 2);
           # the target in float32: torch's bf16 GEMM on a CPU without AVX-512 is a plain loop
           # (about 7x slower than float32 on the 2-core AMD EPYC CI machines)
           "--train-args=--target-batch-size 2 --target-dtype float32"]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, env=_env(tmp_path), capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recipe = json.loads((out / "recipe.json").read_text())
    assert set(recipe["arms"]) == {"dspark", "mtp1"}
    for arm in ("dspark", "mtp1"):
        info = recipe["arms"][arm]
        assert info["steps"] == info["steps_planned"] == 3 and not info["time_boxed"]
        assert info["lm_head_positions"] > 0 and info["sequences_seen"] == 6
        assert list(info["heldout_tau"]) == ["0", "2", "3"]  # held-out curve: start, every 2, end
        assert all(1.0 <= v <= 8.0 for v in info["heldout_tau"].values())
    # dspark starts from the shipped drafter (in the tree), mtp1 from the one the bundle carried
    assert recipe["arms"]["dspark"]["init"] == str(REPO / "sglang_dspark/assets/smollm2-dspark")
    assert recipe["arms"]["mtp1"]["init"].endswith("init/mtp1")
    assert recipe["phases"]["data"]["sequences"] == 7861 and recipe["phases"]["probe"]["steps"] == 3
    assert len(list(out.glob("results.tar.part-*"))) == recipe["results"]["parts"] >= 1

    runs = tmp_path / "runs"
    assert gpu_recipe.main(["unpack", "--parts", str(out), "--out", str(runs)]) == 0
    from sglang_dspark.drafter.formats.checkpoint import load_draft, load_mtp_draft
    from sglang_dspark.drafter.training.target import load_target_config

    target = load_target_config(work / "SmolLM2-135M-Instruct-bfloat16")
    assert load_draft(runs / "dspark" / "draft", target_config=target) is not None
    assert load_mtp_draft(runs / "mtp1" / "draft", target_config=target) is not None
    assert len((runs / "dspark" / "eval.jsonl").read_text().splitlines()) == 3

    # A cut part is caught by unpack, not extracted.
    part = out / "results.tar.part-0"
    part.write_bytes(part.read_bytes()[:-10])
    assert gpu_recipe.main(["unpack", "--parts", str(out), "--out", str(tmp_path / "x")]) == 2


def test_run_refuses_a_corrupt_or_missing_part(bundle, tmp_path):
    gathered = bundle[2]
    bad = tmp_path / "bad"
    shutil.copytree(gathered, bad)
    part = bad / "bundle.part-01"
    data = bytearray(part.read_bytes())
    data[1000] ^= 0xFF
    part.write_bytes(bytes(data))
    args = [
        "run",
        "--bundle",
        str(bad),
        "--out",
        str(tmp_path / "o"),
        "--work",
        str(tmp_path / "w"),
    ]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          env=_env(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "a part is corrupt" in proc.stderr
    part.unlink()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          env=_env(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "bundle.part-01" in proc.stderr


def test_training_commands_need_no_sglang(tmp_path):
    """`sglang-dspark train` and `data build` import only their own modules: they run on a
    GPU training box that has no SGLang."""
    for cmd in (["train", "--help"], ["data", "build", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "sglang_dspark.cli", *cmd], check=False,
                              env=_env(tmp_path),
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0 and "usage: sglang-dspark" in proc.stdout, proc.stderr[-2000:]
