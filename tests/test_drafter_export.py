"""Export to SGLang, DeepSpec import, random init, and the errors bad inputs give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dspark.drafter.config import (
    DSparkDraftConfig,
    default_target_layer_ids,
    validate_draft_for_target,
)
from sglang_dspark.drafter.formats.checkpoint import (
    DraftCheckpointError,
    export_main,
    import_deepspec,
    init_random_draft,
    load_draft,
    make_draft_main,
    save_draft,
    sglang_load_check,
    validate_checkpoint,
)
from sglang_dspark.drafter.model import DSparkDrafter, init_weights
from sglang_dspark.drafter.training.target import load_target_config, make_tiny_target

torch.set_num_threads(1)

SMOLLM2 = {  # SmolLM2-135M-Instruct's shape (config.json fields that matter here)
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "rope_theta": 100000,
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("target") / "llama", num_layers=4)


def _drafter(target_dir: Path, head_type: str = "vanilla", **kw) -> DSparkDrafter:
    cfg = DSparkDraftConfig.for_target(
        load_target_config(target_dir),
        num_layers=2,
        block_size=4,
        markov_rank=16,
        markov_head_type=head_type,
        target_layer_ids=[0, 2],
        **kw,
    )
    d = DSparkDrafter(cfg)
    init_weights(d, seed=3)
    return d


# ------------------------------------------------------------------ export format
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_export_names_shapes_and_config(tmp_path, target_dir, head_type):
    d = _drafter(target_dir, head_type)
    out = save_draft(d, tmp_path / "draft", dtype=torch.float32)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
    for key, value in {
        "block_size": 4,
        "markov_rank": 16,
        "markov_head_type": head_type,
        "target_layer_ids": [0, 2],
        "num_target_layers": 4,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
    }.items():
        assert raw[key] == value, key
    assert raw["mask_token_id"] < 256
    tensors = load_file(str(out / "model.safetensors"))
    H, V, r = 64, 256, 16
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in tensors)
    assert tensors["fc.weight"].shape == (H, 2 * H)
    assert tensors["markov_head.markov_w1.weight"].shape == (V, r)
    assert tensors["markov_head.markov_w2.weight"].shape == (V, r)
    assert tensors["confidence_head.proj.weight"].shape == (1, H + r)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            assert f"layers.{i}.self_attn.{p}.weight" in tensors
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert f"layers.{i}.mlp.{p}.weight" in tensors
    if head_type == "gated":
        assert tensors["markov_head.gate_proj.weight"].shape == (r, H + r)
    if head_type == "rnn":
        assert tensors["markov_head.joint_proj.weight"].shape == (3 * r, 2 * r + H)
    # Round trip.
    back = load_draft(out, target_config=target_dir)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_sglang_loader_accepts_export(tmp_path, target_dir, head_type):
    """SGLang's own Qwen3DSparkModel.load_weights (name mapping, qkv / gate_up fusion, the
    confidence-head check) loads the export, and every SGLang parameter gets our values."""
    import sglang.srt.models.dspark  # noqa: F401  (a hard dependency: never skipped)

    d = _drafter(target_dir, head_type)
    out = save_draft(d, tmp_path / "draft", dtype=torch.float32)
    sgl = sglang_load_check(out)
    ours = d.state_dict()
    params = dict(sgl.named_parameters())
    for i in range(2):
        a = f"layers.{i}.self_attn."
        qkv = torch.cat([ours[a + f"{p}_proj.weight"] for p in "qkv"])
        torch.testing.assert_close(params[a + "qkv_proj.weight"], qkv)
        m = f"layers.{i}.mlp."
        gate_up = torch.cat([ours[m + "gate_proj.weight"], ours[m + "up_proj.weight"]])
        torch.testing.assert_close(params[m + "gate_up_proj.weight"], gate_up)
    unfused = [n for n in ours if "_proj" not in n or "markov" in n or "confidence" in n]
    unfused += [n for n in ours if n.endswith(("o_proj.weight", "down_proj.weight"))]
    for n in unfused:
        torch.testing.assert_close(params[n].float(), ours[n], msg=n)


# ------------------------------------------------------------------ DeepSpec import
def _write_deepspec(tmp: Path, d: DSparkDrafter, target_dir: Path, *, prefix: str = "") -> Path:
    """A checkpoint as DeepSpec's Qwen3 DSpark trainer writes it: the target's full config
    plus DSpark keys and training knobs, and a state_dict with embedding and LM head."""
    src = tmp / "deepspec"
    src.mkdir()
    cfg = dict(load_target_config(target_dir))
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        num_target_layers=4,
        num_hidden_layers=d.config.num_hidden_layers,
        block_size=d.config.block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * d.config.num_hidden_layers,
        mask_token_id=d.config.mask_token_id,
        target_layer_ids=d.config.target_layer_ids,
        num_anchors=512,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=d.config.markov_rank,
        markov_head_type=d.config.markov_head_type,
        head_dim=d.config.head_dim,
        rms_norm_eps=d.config.rms_norm_eps,
        intermediate_size=d.config.intermediate_size,
    )
    (src / "config.json").write_text(json.dumps(cfg))
    state = {prefix + k: v.clone() for k, v in d.state_dict().items()}
    state[prefix + "embed_tokens.weight"] = torch.randn(256, 64)
    state["lm_head.weight"] = torch.randn(256, 64)
    save_file(state, str(src / "model.safetensors"))
    return src


@pytest.mark.parametrize("prefix", ["", "model."])
def test_import_deepspec(tmp_path, target_dir, prefix):
    d = _drafter(target_dir)
    src = _write_deepspec(tmp_path, d, target_dir, prefix=prefix)
    out = tmp_path / "sglang"
    imported = import_deepspec(src, out, target_dir=target_dir, dtype=torch.float32)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(imported.state_dict()[k], v)
    raw = json.loads((out / "config.json").read_text())
    assert "num_anchors" not in raw and raw["architectures"] == ["Qwen3DSparkModel"]
    assert validate_checkpoint(out, target_dir) == []
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(d.state_dict())


def test_deepspec_for_another_vocab_is_refused(tmp_path, target_dir):
    other = make_tiny_target(tmp_path / "other", vocab_size=300)
    d = _drafter(other)
    src = _write_deepspec(tmp_path, d, other)
    with pytest.raises(
        DraftCheckpointError, match=r"vocab_size 300 differs from the target vocabulary \(256\)"
    ):
        import_deepspec(src, tmp_path / "out", target_dir=target_dir)


# ------------------------------------------------------------------ random init
def test_init_random_draft(tmp_path, target_dir):
    out = init_random_draft(
        target_dir, tmp_path / "rand", block_size=5, num_layers=1, markov_rank=8, seed=1
    )
    d = load_draft(out, target_config=target_dir)
    assert d.config.block_size == 5 and d.config.markov_rank == 8
    assert d.config.target_layer_ids == [0, 1, 2]  # m = min(5, L - 1); never layer L - 1
    again = init_random_draft(
        target_dir, tmp_path / "rand2", block_size=5, num_layers=1, markov_rank=8, seed=1
    )
    a = load_file(str(out / "model.safetensors"))
    b = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded: reproducible


def test_cli_make_draft_and_export(tmp_path, target_dir, capsys):
    assert (
        make_draft_main(
            [
                str(target_dir),
                str(tmp_path / "a"),
                "--block-size",
                "3",
                "--markov-rank",
                "8",
                "--target-layer-ids",
                "0,1",
            ]
        )
        == 0
    )
    assert export_main([str(tmp_path / "a"), str(tmp_path / "b"), "--target", str(target_dir)]) == 0
    assert load_draft(tmp_path / "b").config.target_layer_ids == [0, 1]
    with pytest.raises(SystemExit) as e:
        make_draft_main([str(target_dir), str(tmp_path / "c"), "--target-layer-ids", "0,3"])
    assert e.value.code == 2
    assert "last layer" in capsys.readouterr().err


# ------------------------------------------------------------------ validation
def test_smollm2_layer_ids():
    """The crash seen on SmolLM2 (30 layers): id 29 is never captured by SGLang."""
    bad = DSparkDraftConfig.for_target(SMOLLM2, target_layer_ids=[1, 8, 15, 22, 29])
    problems = validate_draft_for_target(bad, SMOLLM2)
    assert len(problems) == 1
    assert "target_layer_id 29 is the last layer" in problems[0]
    assert "only 4 of 5 features" in problems[0]
    good = DSparkDraftConfig.for_target(SMOLLM2, target_layer_ids=[1, 8, 15, 22, 27])
    assert validate_draft_for_target(good, SMOLLM2) == []
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert DSparkDraftConfig.for_target(SMOLLM2).target_layer_ids == [1, 8, 14, 20, 27]
    for ids, needle in (
        ([-1, 8], "negative"),
        ([8, 1], "strictly increasing"),
        ([1, 30], "out of range"),
        ([3, 3], "strictly increasing"),
    ):
        cfg = DSparkDraftConfig.for_target(SMOLLM2, target_layer_ids=ids)
        assert any(needle in p for p in validate_draft_for_target(cfg, SMOLLM2)), ids


def test_validation_messages():
    cfg = DSparkDraftConfig.for_target(SMOLLM2, target_layer_ids=[1, 8, 15, 22, 27])
    cfg.mask_token_id = 60000
    problems = validate_draft_for_target(cfg, SMOLLM2)
    assert problems == [  # one message for the one fault (the draft's own bound is the same)
        "mask_token_id 60000 is outside the target vocabulary (49152); set it below 49152."
    ]
    cfg = DSparkDraftConfig.for_target(SMOLLM2, target_layer_ids=[1, 8, 15, 22, 27])
    other = dict(SMOLLM2, hidden_size=960, vocab_size=50000)
    problems = validate_draft_for_target(cfg, other, block_size=5)
    text = "\n".join(problems)
    assert "hidden_size 576 differs from the target's 960" in text
    assert "vocab_size 49152 differs from the target vocabulary (50000)" in text
    assert "requested block size (gamma) 5 differs from the draft's block_size 7" in text
    cfg.markov_rank = 0
    assert any("markov_rank > 0" in p for p in validate_draft_for_target(cfg, SMOLLM2))


# ------------------------------------------------------------------ bad checkpoints
@pytest.fixture
def good_draft(tmp_path, target_dir) -> Path:
    return save_draft(_drafter(target_dir), tmp_path / "good", dtype=torch.float32)


def _edit(draft: Path, fn) -> Path:
    path = draft / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))
    return draft


def test_missing_tensor(good_draft):
    _edit(good_draft, lambda t: t.pop("layers.1.mlp.down_proj.weight"))
    with pytest.raises(
        DraftCheckpointError, match=r"missing tensors \['layers.1.mlp.down_proj.weight'\]"
    ):
        load_draft(good_draft)


def test_missing_confidence_head(good_draft):
    _edit(good_draft, lambda t: [t.pop(k) for k in list(t) if k.startswith("confidence_head")])
    with pytest.raises(DraftCheckpointError, match="missing confidence head tensors"):
        load_draft(good_draft)


def test_wrong_shape(good_draft):
    _edit(good_draft, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 192)))
    with pytest.raises(
        DraftCheckpointError,
        match=r"fc.weight has shape \[64, 192\], expected \[64, 128\].*m = len\(target_layer_ids\) = 2",
    ):
        load_draft(good_draft)


def test_unexpected_tensor(good_draft):
    _edit(good_draft, lambda t: t.__setitem__("layers.7.mlp.up_proj.weight", torch.zeros(1)))
    with pytest.raises(DraftCheckpointError, match="unexpected tensors"):
        load_draft(good_draft)


def test_truncated_safetensors(good_draft):
    path = good_draft / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftCheckpointError, match="truncated"):
        load_draft(good_draft)


def test_pickles_are_never_loaded(tmp_path, good_draft):
    (good_draft / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(1)}, good_draft / "pytorch_model.bin")
    with pytest.raises(DraftCheckpointError, match="never loaded"):
        load_draft(good_draft)


def test_draft_for_wrong_target(tmp_path, good_draft):
    other = make_tiny_target(tmp_path / "big", hidden_size=32, vocab_size=128, num_layers=3)
    problems = validate_checkpoint(good_draft, other)
    assert len(problems) == 1
    text = problems[0]
    assert "hidden_size 64 differs" in text and "vocab_size 256 differs" in text
    assert "target_layer_id 2 is the last layer" in text


def test_missing_config(tmp_path):
    with pytest.raises(DraftCheckpointError, match="config.json does not exist"):
        load_draft(tmp_path)


def test_default_mask_token_id():
    from sglang_dspark.drafter.config import default_mask_token_id

    # SmolLM2: pad == eos == 2 -> not the pad token; the last vocabulary id instead.
    assert default_mask_token_id(dict(SMOLLM2, pad_token_id=2, eos_token_id=2)) == 49151
    assert default_mask_token_id(dict(SMOLLM2, pad_token_id=5, eos_token_id=2)) == 5
    assert default_mask_token_id(dict(SMOLLM2, padded_vocab_size=49280)) == 49152


def test_deepspec_embedding_layer_id_is_refused(tmp_path, target_dir):
    d = _drafter(target_dir)
    src = _write_deepspec(tmp_path, d, target_dir)
    raw = json.loads((src / "config.json").read_text())
    raw["target_layer_ids"] = [-1, 2]
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DraftCheckpointError, match="target_layer_id -1 is negative"):
        import_deepspec(src)
