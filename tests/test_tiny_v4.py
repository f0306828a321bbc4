"""The tiny DeepSeek-V4 checkpoint (sglang_dspark/v4/tiny.py, random weights).

SGLang 0.5.23's own loader takes it: every tensor lands in a parameter of
DeepseekV4ForCausalLM (target) or DeepseekV4ForCausalLMDSpark (the bundled draft), every
parameter gets a tensor, dtypes match (tests/v4_sglang_load.py, in a child process: SGLang
needs a gloo group and its CPU set-up). transformers' DeepseekV4 reads it back exactly. The
build is deterministic for a seed, idempotent, and never leaves a half-written directory.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dspark.drafter.formats.v4_names import to_deepseek_names
from sglang_dspark.v4 import tiny

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return tiny.build_tiny_v4(tmp_path_factory.mktemp("tiny-v4") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def tensors(built) -> dict[str, torch.Tensor]:
    return load_file(built / tiny.WEIGHTS_NAME)


@pytest.fixture(scope="module")
def broken(built, tensors, tmp_path_factory) -> Path:
    """Negative control: one tensor dropped, one misnamed (target and draft), one in the
    wrong dtype."""
    out = tmp_path_factory.mktemp("tiny-v4-broken")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(built / name, out / name)
    t = dict(tensors)
    del t["layers.1.attn.compressor.ape"]
    t["layers.0.ffn.gate.weights"] = t.pop("layers.0.ffn.gate.weight")
    t["mtp.1.attn.wq_b.weights"] = t.pop("mtp.1.attn.wq_b.weight")
    t["layers.2.attn.attn_sink"] = t["layers.2.attn.attn_sink"].bfloat16()
    save_file(t, str(out / tiny.WEIGHTS_NAME))
    return out


@pytest.fixture(scope="module")
def sglang_load(built, broken) -> dict:
    """SGLang's reports for the built checkpoint and the negative control (one child)."""
    child = subprocess.run(
        [sys.executable, str(HERE / "v4_sglang_load.py"), str(built), str(broken)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-6000:]
    reports = json.loads(child.stdout.strip().splitlines()[-1])
    return {"good": reports[str(built)], "broken": reports[str(broken)]}


def _numel(shapes) -> int:
    return sum(math.prod(shape) for shape in shapes)


# ------------------------------------------------------------------ SGLang's loader
@pytest.mark.slow
def test_every_target_tensor_fills_a_parameter_of_sglangs_deepseek_v4(sglang_load, tensors):
    r = sglang_load["good"]["target"]
    assert r["architecture"] == "DeepseekV4ForCausalLM"
    assert set(r["read"]) == set(tensors)  # SGLang's iterator read the whole file
    assert r["untouched"] == []  # every parameter was written (no sentinel left) ...
    assert r["warnings"] == []  # ... and no tensor was refused
    # Nothing dropped silently, nothing written twice: the target's tensors are exactly as
    # large as its parameters (the draft's mtp.* tensors are the loader's to skip).
    target = [t.shape for n, t in tensors.items() if not n.startswith("mtp.")]
    assert _numel(target) == _numel(s for s, _ in r["params"].values())
    assert r["dtype_mismatch"] == [] and r["dtype_checked"] > 50


@pytest.mark.slow
def test_every_draft_tensor_fills_a_parameter_of_sglangs_dspark_draft(sglang_load, tensors):
    r = sglang_load["good"]["draft"]
    # Same directory as the target: ModelConfig picks the draft architecture from dspark_*.
    assert r["architecture"] == "DeepseekV4ForCausalLMDSpark"
    assert r["untouched"] == [] and r["warnings"] == []
    draft = [t.shape for n, t in tensors.items() if n.startswith("mtp.")]
    assert _numel(draft) == _numel(s for s, _ in r["params"].values())
    assert r["dtype_mismatch"] == [] and r["dtype_checked"] > 30
    params = r["params"]
    stages = {n.split(".")[1] for n in params if n.startswith("stages.")}
    assert stages == {"0", "1", "2"}  # one per dspark_target_layer_ids entry
    assert "stages.0.main_proj.weight" in params and "stages.2.hc_head_fn" in params
    assert params["confidence_head.proj.weight"] == [[1, 256 + 32], "float32"]
    assert params["markov_head.markov_w1.weight"][0] == [49152, 32]


@pytest.mark.slow
def test_the_target_has_every_v4_layer_kind(sglang_load):
    params = sglang_load["good"]["target"]["params"]

    def has(layer: int, part: str) -> bool:
        return any(n.startswith(f"model.layers.{layer}.{part}") for n in params)

    assert [has(i, "self_attn.compressor.") for i in range(4)] == [False, True, True, True]
    assert [has(i, "self_attn.indexer.") for i in range(4)] == [False, True, False, True]
    assert params["model.layers.1.self_attn.compressor.ape"][0] == [4, 2 * 512]  # C4 overlap
    assert params["model.layers.2.self_attn.compressor.ape"][0] == [128, 512]
    assert [has(i, "mlp.topk.tid2eid") for i in range(4)] == [True, True, False, False]
    assert [has(i, "mlp.gate.e_score_correction_bias") for i in range(4)] == [
        False, False, True, True,
    ]  # fmt: skip
    assert all(has(i, "hc_attn_fn") and has(i, "mlp.shared_experts.") for i in range(4))
    assert "model.hc_head_fn" in params


@pytest.mark.slow
def test_the_load_check_catches_missing_misnamed_and_mistyped_tensors(sglang_load):
    target, draft = sglang_load["broken"]["target"], sglang_load["broken"]["draft"]
    assert target["untouched"] == [
        "model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.compressor.ape",
    ]  # fmt: skip
    assert any("model.layers.0.mlp.gate.weights not found" in w for w in target["warnings"])
    mistyped = "layers.2.attn.attn_sink: checkpoint bfloat16, model.layers.2.self_attn.attn_sink"
    assert target["dtype_mismatch"] == [f"{mistyped} torch.float32"]
    assert draft["untouched"] == ["stages.1.self_attn.wq_b.weight"]
    assert any("unexpected weight 'mtp.1.attn.wq_b.weights'" in w for w in draft["warnings"])


# ------------------------------------------------------------------ contents
def test_config_marks_a_bundled_dspark_draft_and_uses_smollm2s_tokenizer(built, tensors):
    from sglang.srt.speculative.dspark_components.dspark_config import (
        checkpoint_bundles_dspark_draft,
        parse_dspark_draft_config,
    )
    from transformers import AutoTokenizer

    cfg = json.loads((built / "config.json").read_text())
    assert checkpoint_bundles_dspark_draft(cfg)  # SGLang defaults the draft path to the model
    draft = parse_dspark_draft_config(draft_hf_config=cfg)
    assert (draft.gamma, draft.markov_rank, draft.target_layer_ids) == (5, 32, [1, 2, 3])
    assert draft.mask_token_id == 49151 and draft.mask_token_id not in (1, 2)
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    assert cfg["rope_scaling"]["type"] == "yarn"
    assert tensors["embed.weight"].shape == (49152, 256)

    from sglang_dspark.serving.smollm2 import ensure_smollm2

    text = "Natalia sold clips to 48 of her friends in April."
    ours = AutoTokenizer.from_pretrained(built).encode(text)
    assert ours == AutoTokenizer.from_pretrained(ensure_smollm2()).encode(text)
    assert max(ours) < cfg["vocab_size"]


def test_dtypes_and_hash_routing_table(tensors):
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.hc_attn_fn"].dtype == torch.float32
    assert tensors["layers.1.attn.indexer.compressor.ape"].dtype == torch.float32
    tid2eid = tensors["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.dtype == torch.int32 and tid2eid.shape == (49152, 2)
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # two distinct experts per token
    assert set(tid2eid.unique().tolist()) == set(range(8))
    assert not any(t.dtype == torch.float8_e4m3fn for t in tensors.values())


def test_transformers_reads_the_target_back_exactly(built, tensors):
    """DeepSeek's names, read through transformers' deepseek_v4 conversion mapping, give the
    tensors that were renamed: to_deepseek_names is that mapping's inverse. transformers'
    reference runs in float32 (in bf16 its fp32-kept norms feed bf16 linears and fail)."""
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(
        built, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    back = to_deepseek_names(model.state_dict())
    target = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    assert set(back) == set(target)
    assert [n for n, t in target.items() if not torch.equal(back[n].to(t.dtype), t)] == []
    with torch.no_grad():
        logits = model(torch.tensor([[1, 504, 3145, 314, 2]])).logits
    assert logits.shape == (1, 5, 49152) and torch.isfinite(logits).all()


# ------------------------------------------------------------------ the build
def _sha(path: Path) -> str:
    return tiny._file_sha256(path)


def _marker(path: Path) -> dict:
    return json.loads((path / tiny.MARKER).read_text())


def test_same_seed_same_bytes(built, tensors, tmp_path):
    again = tiny.build_tiny_v4(tmp_path / "again", seed=0)
    assert _sha(again / tiny.WEIGHTS_NAME) == _sha(built / tiny.WEIGHTS_NAME)
    assert _marker(again)["tensors_sha256"] == _marker(built)["tensors_sha256"]
    assert tiny.tensor_digest(tensors) == _marker(built)["tensors_sha256"]


def test_the_target_does_not_depend_on_the_draft_and_the_seed_changes_it(tensors, tmp_path):
    target = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    alone = tiny.build_tiny_v4(tmp_path / "alone", seed=0, with_draft=False)
    assert tiny.tensor_digest(load_file(alone / tiny.WEIGHTS_NAME)) == tiny.tensor_digest(target)
    assert not any(k.startswith("dspark_") for k in json.loads((alone / "config.json").read_text()))
    other = load_file(tiny.build_tiny_v4(tmp_path / "seed1", seed=1, with_draft=False)
                      / tiny.WEIGHTS_NAME)  # fmt: skip
    assert set(other) == set(target)
    assert not torch.equal(other["layers.0.attn.wq_a.weight"], target["layers.0.attn.wq_a.weight"])


def test_a_finished_build_is_returned_without_rebuilding(built, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a valid checkpoint")

    monkeypatch.setattr(tiny, "target_tensors", no_rebuild)
    assert tiny.build_tiny_v4(built, seed=0) == built
    assert tiny.check_tiny_v4(built) is None
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


@pytest.mark.parametrize("damage", ["truncate weights", "delete tokenizer", "garble marker"])
def test_a_damaged_build_is_rebuilt(built, tmp_path, damage):
    out = tmp_path / "ckpt"
    shutil.copytree(built, out)
    if damage == "truncate weights":
        with open(out / tiny.WEIGHTS_NAME, "r+b") as f:
            f.truncate(1 << 20)
    elif damage == "delete tokenizer":
        (out / "tokenizer.json").unlink()
    else:
        (out / tiny.MARKER).write_text("{")
    assert tiny.check_tiny_v4(out) is not None
    assert tiny.build_tiny_v4(out, seed=0) == out
    assert tiny.check_tiny_v4(out) is None
    assert _sha(out / tiny.WEIGHTS_NAME) == _sha(built / tiny.WEIGHTS_NAME)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left


def test_a_directory_that_is_not_a_build_is_refused(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(tiny.TinyV4Error, match="not a tiny DeepSeek-V4 build.*another --out"):
        tiny.build_tiny_v4(out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_a_build_for_another_seed_is_refused_unless_forced(built, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(built, out)
    with pytest.raises(tiny.TinyV4Error, match="seed=0.*--force"):
        tiny.build_tiny_v4(out, seed=1)
    assert tiny.check_tiny_v4(out) is None  # untouched
    tiny.build_tiny_v4(out, seed=1, with_draft=False, force=True)
    assert tiny.check_tiny_v4(out, seed=1, with_draft=False) is None


def test_a_failed_build_leaves_nothing_and_abandoned_temporaries_are_cleaned(tmp_path, monkeypatch):
    dead_pid = 2**22 + 12345  # above Linux's pid_max default: no such process
    abandoned = tmp_path / f".ckpt.tmp-{dead_pid}-x1"
    abandoned.mkdir()
    (abandoned / tiny.WEIGHTS_NAME).write_bytes(b"partial")

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "draft_tensors", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        tiny.build_tiny_v4(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_the_checkpoint_and_reports_a_refusal(built, tmp_path, capsys):
    from sglang_dspark.cli import main

    assert main(["setup-tiny-v4", "--out", str(built)]) == 0
    assert capsys.readouterr().out.strip() == str(built)
    (tmp_path / "x.txt").write_text("")
    assert main(["setup-tiny-v4", "--out", str(tmp_path)]) == 2
    assert "not a tiny DeepSeek-V4 build" in capsys.readouterr().err


def test_default_location_is_the_project_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    assert tiny.default_dir() == tmp_path / "tiny-deepseek-v4"
