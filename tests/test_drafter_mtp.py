"""MTP-1 baseline drafter: SGLang parity, causality, loss, budget, resume, export errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_dspark.drafter.formats.checkpoint import (
    DraftCheckpointError,
    export_main,
    init_random_mtp_draft,
    load_draft,
    load_mtp_draft,
    make_draft_main,
    save_mtp_draft,
    sglang_mtp_load_check,
    validate_checkpoint,
)
from sglang_dspark.drafter.model import apply_rope, init_weights
from sglang_dspark.drafter.mtp import MtpDraftConfig, MtpDrafter
from sglang_dspark.drafter.training.config import TrainConfig
from sglang_dspark.drafter.training.loss import LossWeights, combine, loss_sums
from sglang_dspark.drafter.training.registry import build_trainer
from sglang_dspark.drafter.training.target import (
    TargetAdapter,
    load_target_config,
    make_tiny_target,
)
from sglang_dspark.drafter.training.train_mtp import (
    MtpTrainer,
    mtp_candidates,
    sample_mtp_positions,
)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
V, H = 256, 64  # make_tiny_target's defaults (4 heads, 2 kv heads, head_dim 16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    target = make_tiny_target(root / "target", num_layers=4)
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(24):
            n, p = rng.randint(16, 48), rng.randint(2, 8)
            motif = [rng.randrange(V) for _ in range(3)]
            ids = [rng.randrange(V) for _ in range(p)] + [motif[j % 3] for j in range(n - p)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)}) + "\n")
    return root, target


def _cfg(root: Path, target: Path, out: str, **kw) -> TrainConfig:
    base = {
        "data": str(root / "data.jsonl"),
        "target": str(target),
        "out_dir": str(root / out),
        "drafter": "mtp",
        "block_size": 3,
        "num_anchors": 2,  # <= 6 supervised positions per sequence
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "steps": 8,
        "checkpoint_every": 3,
        "lr": 3e-3,
        "warmup_ratio": 0.25,
        "precision": "fp32",
        "export_dtype": "float32",
        "progress": False,
        "seed": 7,
    }
    base.update(kw)
    return TrainConfig(**base)


def _drafter(target: Path, *, seed: int = 3, std: float = 0.2, **rope) -> MtpDrafter:
    config = MtpDraftConfig.for_target(load_target_config(target))
    if rope:
        config = dataclasses.replace(config, rope=rope)
    d = MtpDrafter(config)
    init_weights(d, seed=seed, std=std)
    gen = torch.Generator().manual_seed(seed + 1)
    d.attach_shared(torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen))
    return d.eval()


# ------------------------------------------------------------------ SGLang's own loader
LLAMA3_ROPE = {
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
}
ROPES = {"theta50000": {"rope_theta": 50000.0}, "llama3": LLAMA3_ROPE}


class _CausalExtendAttention(nn.Module):
    """What SGLang's attention backends compute for the draft's EXTEND of one request with
    no cached prefix: causal softmax(q k^T * scaling) v with GQA (RadixAttention's stand-in)."""

    def __init__(self, radix) -> None:
        super().__init__()
        self.head_dim, self.scaling = radix.head_dim, radix.scaling

    def forward(self, q, k, v, forward_batch, **kw):
        S, hd = q.shape[0], self.head_dim
        q, k, v = (t.reshape(S, -1, hd) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * self.scaling
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(S, -1)


def _single_rank():
    from sglang.srt.runtime_context import get_parallel

    one = SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True)
    return get_parallel().override(pp_group=one, tp_group=one, tp_rank=0, tp_size=1)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_sglang_loader_receives_every_tensor_and_forward_matches(tmp_path, setup, rope):
    """Our export through SGLang 0.5.23's LlamaForCausalLMEagle3 (its config parsing,
    load_weights name mapping and q/k/v, gate/up fusion), then SGLang's own LlamaModel.forward
    (norms, concat, fused qkv, RoPE, o_proj, residuals, MLP, final norm) with the target's
    embedding / LM head installed as the EAGLE3 worker does (set_embed_and_head), against
    MtpDrafter's logits. Only the attention kernel is a reference (_CausalExtendAttention)."""
    _, target = setup
    ours = _drafter(target, seed=11, **ROPES[rope])
    out = save_mtp_draft(ours, tmp_path / "draft", dtype=torch.float32)
    sgl = sglang_mtp_load_check(out).float().eval()
    assert sgl.config.draft_vocab_size == V and sgl.load_lm_head_from_target  # head from target

    # Every parameter SGLang uses holds our tensor; the only ones it does not get from us are
    # the target's embedding / LM head (installed by the worker) and fc, which its forward
    # skips (target hidden width == H). fc is [H, 3H]: SGLang's default aux count.
    mine = ours.state_dict()
    params = dict(sgl.named_parameters())
    p = "model.layers.0."
    expected = {
        p + "self_attn.qkv_proj.weight": torch.cat(
            [mine[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
        ),
        p + "mlp.gate_up_proj.weight": torch.cat(
            [mine["layers.0.mlp.gate_proj.weight"], mine["layers.0.mlp.up_proj.weight"]]
        ),
        "model.norm.weight": mine["norm.weight"],
    }
    for n in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "hidden_norm",
              "post_attention_layernorm"):  # fmt: skip
        expected[f"{p}{n}.weight"] = mine[f"layers.0.{n}.weight"]
    assert set(params) - set(expected) == {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.fc.weight",
    }
    assert tuple(params["model.fc.weight"].shape) == (H, 3 * H)
    for name, want in expected.items():
        torch.testing.assert_close(params[name].data, want, rtol=0, atol=0, msg=name)
    rotary = sgl.model.layers[0].self_attn.rotary_emb
    assert rotary.base == pytest.approx(float(ours.config.rope_parameters["rope_theta"]))

    # Full forward on one request: rows (h_t, x_{t+1}) at positions t = 0..S-1.
    sgl.set_embed_and_head(ours.shared.embed_weight.clone(), ours.shared.lm_head_weight.clone())
    sgl.model.layers[0].self_attn.attn = _CausalExtendAttention(sgl.model.layers[0].self_attn.attn)
    gen = torch.Generator().manual_seed(12)
    S = 12
    hidden = torch.randn(S, H, generator=gen)
    tokens = torch.randint(0, V, (S,), generator=gen)
    positions = torch.arange(S)
    mode = SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False)
    batch = SimpleNamespace(
        spec_info=SimpleNamespace(hidden_states=hidden),
        forward_mode=mode,
        mm_input_embeds=None,
        contains_mm_inputs=lambda: False,
    )
    with torch.no_grad(), _single_rank():
        h_sgl, _aux = sgl.model(input_ids=tokens, positions=positions, forward_batch=batch)
        logits_sgl = F.linear(h_sgl, sgl.lm_head.weight)
        # RoPE piece on its own at long positions (where llama3's scaling shows).
        far = torch.tensor([5, 300, 511])  # < max_position_embeddings
        q, k = torch.randn(3, 4 * 16, generator=gen), torch.randn(3, 2 * 16, generator=gen)
        q_sgl, k_sgl = rotary.forward_native(far, q.clone(), k.clone())
        h_ours = ours(hidden, tokens, positions)
        logits_ours = ours.logits(h_ours)
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(h_sgl, h_ours, **tol)
    torch.testing.assert_close(logits_sgl, logits_ours, **tol)
    attn = ours.layers[0].self_attn
    if rope == "llama3":  # the scaling really is applied: low frequencies divided by 8
        plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
        assert torch.allclose(attn.inv_freq[0], plain[0])
        assert torch.allclose(attn.inv_freq[-1], plain[-1] / 8)
    freqs = far.float()[:, None] * attn.inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos() * attn.rope_scale, emb.sin() * attn.rope_scale
    torch.testing.assert_close(apply_rope(q.view(3, 4, 16), cos, sin).view(3, -1), q_sgl, **tol)
    torch.testing.assert_close(apply_rope(k.view(3, 2, 16), cos, sin).view(3, -1), k_sgl, **tol)


def test_export_format(tmp_path, setup):
    _, target = setup
    out = init_random_mtp_draft(target, tmp_path / "draft", seed=1)
    raw = json.loads((out / "config.json").read_text())
    t = load_target_config(target)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is False
    assert raw["eagle_config"] == {"use_aux_hidden_state": False}
    assert raw["draft_vocab_size"] is None and raw["torch_dtype"] == "bfloat16"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "hidden_act"):  # fmt: skip
        assert raw[key] == t[key], key
    assert raw["rope_parameters"] == t["rope_parameters"]
    names = set(load_file(str(out / "model.safetensors")))
    assert names == {
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "norm.weight",
    }
    assert load_file(str(out / "model.safetensors"))["layers.0.self_attn.q_proj.weight"].shape == (
        64, 2 * H)  # fmt: skip
    # make-draft --kind mtp and a round trip through load_mtp_draft.
    assert make_draft_main([str(target), str(tmp_path / "cli"), "--kind", "mtp"]) == 0
    assert validate_checkpoint(tmp_path / "cli", target) == []
    loaded = load_mtp_draft(out, target_config=target)
    assert loaded.config == MtpDraftConfig.for_target(t)


SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json fields that matter here (transformers 5)
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "vocab_size": 49152, "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": True,
}  # fmt: skip


def test_smollm2_shaped_config():
    smol = SMOLLM2
    raw = MtpDraftConfig.for_target(smol).to_sglang_dict()
    assert raw["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    with torch.device("meta"):
        d = MtpDrafter(MtpDraftConfig.from_dict(raw))
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert shapes["layers.0.self_attn.q_proj.weight"] == (9 * 64, 2 * 576)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (3 * 64, 2 * 576)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (1536, 576)


# ------------------------------------------------------------------ causality
@pytest.mark.parametrize("i", [0, 4, 9])
def test_prediction_at_i_ignores_everything_after_i_plus_1(setup, i):
    """Row i reads (h_j, x_{j+1}) for j <= i only, and never the other packed sequence."""
    _, target = setup
    d = _drafter(target)
    gen = torch.Generator().manual_seed(5)
    lens = [12, 9]
    hidden = torch.randn(sum(lens), H, generator=gen)
    tokens = torch.randint(0, V, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        ref = d.logits(d(hidden, tokens, positions, lens))
        h2, t2 = hidden.clone(), tokens.clone()
        h2[i + 1 :] += 3 * torch.randn_like(h2[i + 1 :])  # h_{>i}, and all of sequence B
        t2[i + 1 :] = (t2[i + 1 :] + 1) % V  # x_{>i+1}
        out = d.logits(d(h2, t2, positions, lens))
        torch.testing.assert_close(out[: i + 1], ref[: i + 1], rtol=0, atol=0)
        assert (out[i + 1 : lens[0]] - ref[i + 1 : lens[0]]).abs().amax() > 1e-3
        # The past matters: h_0 and x_1 change row i.
        h3, t3 = hidden.clone(), tokens.clone()
        h3[0] += 1.0
        t3[0] = (t3[0] + 1) % V
        assert (d.logits(d(h3, t3, positions, lens))[i] - ref[i]).abs().amax() > 1e-4
        # Packing changes nothing: sequence B alone == sequence B packed after A.
        alone = d.logits(d(hidden[12:], tokens[12:], positions[12:]))
        torch.testing.assert_close(alone, ref[12:], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ loss
def test_loss_by_hand_on_a_three_token_vocabulary():
    """One position: L = 0.1 * -log p_d(x) + 0.9 * sum_v |p_d(v) - p_t(v)|."""
    z = torch.tensor([[[1.0, 0.0, -1.0]]], requires_grad=True)
    t = torch.tensor([[[0.0, 0.0, 0.0]]])
    sums = loss_sums(z, t, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool), None, decay=0)
    loss = combine(sums, LossWeights(conf=0.0), sums.weight)
    e = [math.e, 1.0, 1 / math.e]
    p_d = [x / sum(e) for x in e]
    tv = sum(abs(p - 1 / 3) for p in p_d)
    assert float(sums.tv) == pytest.approx(tv, rel=1e-6)
    assert float(sums.ce) == pytest.approx(-math.log(p_d[2]), rel=1e-6)
    assert float(loss) == pytest.approx(0.1 * -math.log(p_d[2]) + 0.9 * tv, rel=1e-6)
    assert float(sums.accept) == pytest.approx(1 - tv / 2, rel=1e-6)
    loss.backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


def test_step_loss_equals_an_unpacked_recomputation(setup):
    """The trainer's first-step loss == mean over sampled i of 0.1 CE + 0.9 TV, recomputed
    per sequence over ALL rows 0..S-3 (no packing, no truncation), teacher p_t(.|x_<=i+1)."""
    root, target = setup
    trainer = build_trainer(_cfg(root, target, "byhand", resume=False))
    assert isinstance(trainer, MtpTrainer)
    plan = trainer._plan(0)
    adapter = TargetAdapter.from_pretrained(target, [0])
    ce, tv, n = 0.0, 0.0, 0
    with torch.no_grad():
        for seq, pos in plan:
            final = adapter.features(seq.input_ids).final_hidden
            S = seq.input_ids.numel()
            out = trainer.drafter(final[: S - 2], seq.input_ids[1 : S - 1], torch.arange(S - 2))
            p_d = trainer.drafter.logits(out[pos]).softmax(-1)
            p_t = adapter.logits(final[pos + 1]).softmax(-1)
            labels = seq.input_ids[pos + 2]
            ce += -p_d.gather(-1, labels[:, None]).log().sum().item()
            tv += (p_d - p_t).abs().sum().item()
            n += pos.numel()
    stats = trainer.train_step()
    assert stats.per_term["ce"] == pytest.approx(ce / n, rel=1e-5)
    assert stats.per_term["tv"] == pytest.approx(tv / n, rel=1e-5)
    assert stats.loss == pytest.approx(0.1 * ce / n + 0.9 * tv / n, rel=1e-5)
    assert set(stats.per_term) == {"ce", "tv"} and stats.lm_head_positions == n


def test_training_lowers_the_loss_on_a_fixed_batch(setup, tmp_path):
    root, target = setup
    data = tmp_path / "fixed.jsonl"
    data.write_text("".join(line + "\n" for line in
                            (root / "data.jsonl").read_text().splitlines()[:4]))  # fmt: skip
    # 4 sequences, batch 4, 60 positions per sequence (more than any has): the same batch
    # and the same positions every step.
    trainer = build_trainer(_cfg(root, target, "fixed", data=str(data), num_anchors=20, steps=15,
                           warmup_ratio=0.0, lr=1e-2, checkpoint_every=100))  # fmt: skip
    stats = [trainer.train_step() for _ in range(15)]
    losses, tvs = [s.loss for s in stats], [s.per_term["tv"] for s in stats]
    # The random tiny target's CE is ~log V whatever the drafter does; TV is what it can learn.
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert tvs[-1] < 0.8 * tvs[0], tvs


# ------------------------------------------------------------------ budget
def test_budget_positions_through_the_lm_head(setup):
    """Per sequence min(num_anchors x block_size, |candidates|) positions, seeded like
    DSpark's anchors; the step's lm_head_positions is their sum; with enough candidates it
    equals the DSpark step's num_anchors x block_size per sequence."""
    root, target = setup
    mask = torch.tensor([0] * 3 + [1] * 30, dtype=torch.bool)
    cand = mtp_candidates(mask)
    assert cand.tolist() == list(range(2, 31))  # mask[i+1] and mask[i+2]; i + 2 <= 32
    a = sample_mtp_positions(mask, 6, seed=4)
    assert a.tolist() == sample_mtp_positions(mask, 6, seed=4).tolist()
    assert a.numel() == 6 and set(a.tolist()) <= set(cand.tolist())
    assert sample_mtp_positions(mask, 100, seed=4).tolist() == cand.tolist()

    trainer = build_trainer(_cfg(root, target, "budget", num_anchors=4, block_size=5, resume=False))
    cap = 4 * 5
    plan = trainer._plan(0)
    per_seq = [min(cap, mtp_candidates(s.loss_mask).numel()) for s, _ in plan]
    assert [p.numel() for _, p in plan] == per_seq
    stats = trainer.train_step()
    assert stats.lm_head_positions == sum(per_seq)
    # DSpark with the same settings: full blocks x block_size rows through the LM head.
    dspark = build_trainer(_cfg(root, target, "budget-dspark", drafter="dspark", num_anchors=4,
                          block_size=5, markov_rank=8, target_layer_ids=[0, 2], resume=False))  # fmt: skip
    d_plan = dspark._plan(0)
    d_rows = sum(bt.anchors.numel() for _, bt, _ in d_plan) * 5
    assert dspark.train_step().lm_head_positions == d_rows
    assert [s.index for s, _, _ in d_plan] == [s.index for s, _ in plan]  # same sequences
    for (seq, pos), (_, bt, _) in zip(plan, d_plan):
        if pos.numel() == cap and bt.anchors.numel() == 4:  # enough candidates for both
            assert pos.numel() == bt.anchors.numel() * 5


def test_metrics_record_the_budget(setup):
    root, target = setup
    out = build_trainer(_cfg(root, target, "metrics", steps=2, resume=False)).train()
    recs = [json.loads(x) for x in (out.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["lm_head_budget"] == 4 * 2 * 3 for r in recs)
    assert all(0 < r["lm_head_positions"] <= r["lm_head_budget"] for r in recs)


# ------------------------------------------------------------------ resume
def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "draft" / "model.safetensors"))


def test_resume_matches_uninterrupted_run(setup):
    root, target = setup
    full = build_trainer(_cfg(root, target, "full")).train()
    cfg = _cfg(root, target, "resumed", stop_after=5)
    assert build_trainer(cfg).train().name == "latest.pt"
    resumed = build_trainer(dataclasses.replace(cfg, stop_after=None))
    assert resumed.step == 3
    out = resumed.train()
    a, b = _weights(full.parent), _weights(out.parent)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    lines = (out.parent / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 9))
    # A DSpark run cannot resume an MTP checkpoint.
    with pytest.raises(DraftCheckpointError, match="different drafter"):
        build_trainer(_cfg(root, target, "resumed", drafter="dspark", markov_rank=8,
                     target_layer_ids=[0, 2]))  # fmt: skip


@pytest.mark.slow
def test_kill_9_then_resume(setup):
    """`python -m sglang_dspark.drafter.training.train --config` with drafter mtp, SIGKILL, resume:
    the same weights as a fresh run to the same step."""
    root, target = setup
    cfg = _cfg(root, target, "killed", steps=400, checkpoint_every=2)
    cfg_file = root / "killed.json"
    cfg_file.write_text(json.dumps(dataclasses.asdict(cfg)))
    ckpt = Path(cfg.out_dir) / "checkpoints" / "latest.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_dspark.drafter.training.train", "--config", str(cfg_file)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not ckpt.exists():
        time.sleep(0.2)
    time.sleep(1.0)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = torch.load(ckpt, weights_only=True)
    step = state["step"]
    assert 2 <= step < 400 and state["train_config"]["drafter"] == "mtp"
    resumed = build_trainer(dataclasses.replace(cfg, stop_after=4))
    assert isinstance(resumed, MtpTrainer) and resumed.step == step
    resumed.train()
    fresh = build_trainer(
        dataclasses.replace(cfg, out_dir=str(root / "fresh"), stop_after=step + 4)
    )
    fresh.train()
    a, b = resumed.drafter.state_dict(), fresh.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_torchrun_two_ranks_equals_one(setup):
    root, target = setup
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    runs = {}
    for name, launcher in (
        ("one", [sys.executable]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2"]),
    ):  # fmt: skip
        cfg = _cfg(root, target, f"tr-{name}", steps=4)
        path = root / f"tr-{name}.json"
        path.write_text(json.dumps(dataclasses.asdict(cfg)))
        proc = subprocess.run(
            [*launcher, "-m", "sglang_dspark.drafter.training.train", "--config", str(path)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        metrics = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
        runs[name] = (_weights(Path(cfg.out_dir)), [json.loads(x) for x in metrics])
    (a, m1), (b, m2) = runs["one"], runs["two"]
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    for x, y in zip(m1, m2, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["lm_head_positions"] == y["lm_head_positions"]


def test_cli_trains_exports_and_inits_from_a_draft(setup, tmp_path, capsys):
    from sglang_dspark.drafter.training.cli import main

    root, target = setup
    out = tmp_path / "cli"
    args = ["--data", str(root / "data.jsonl"), "--target", str(target), "--out-dir", str(out),
            "--drafter", "mtp", "--steps", "2", "--num-anchors", "2", "--block-size", "3",
            "--global-batch-size", "2", "--precision", "fp32", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert json.loads((out / "draft" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    # `sglang-dspark export RUN OUT --target T` detects the MTP checkpoint.
    assert export_main([str(out), str(tmp_path / "exported"), "--target", str(target)]) == 0
    a, b = _weights(out), load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert set(a) == set(b)
    # --init-draft: start from an MTP draft directory.
    start = init_random_mtp_draft(target, tmp_path / "start", seed=5, dtype=torch.float32)
    run = build_trainer(
        _cfg(root, target, "from-draft", init_draft=str(start), steps=2, resume=False)
    )
    torch.testing.assert_close(
        run.drafter.norm.weight, load_mtp_draft(start).norm.weight, rtol=0, atol=0
    )
    after = load_mtp_draft(run.train())
    assert not torch.equal(after.layers[0].self_attn.q_proj.weight,
                           load_mtp_draft(start).layers[0].self_attn.q_proj.weight)  # fmt: skip
    # The config file for the real target parses and asks for the MTP kind.
    cfg = TrainConfig.from_json(REPO / "configs/smollm2-mtp1.json", data="d", target="t",
                                out_dir="o")  # fmt: skip
    dspark = TrainConfig.from_json(REPO / "configs/smollm2-dspark.json", data="d", target="t",
                                   out_dir="o")  # fmt: skip
    assert cfg.drafter == "mtp" and dspark.drafter == "dspark"
    for f in ("lr", "warmup_ratio", "min_lr_ratio", "epochs", "global_batch_size",
              "micro_batch_size", "max_length", "num_anchors", "block_size", "seed",
              "precision", "target_dtype", "export_dtype", "ce_weight", "tv_weight"):  # fmt: skip
        assert getattr(cfg, f) == getattr(dspark, f), f


# ------------------------------------------------------------------ bad exports
def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def test_bad_exports_give_clear_errors(tmp_path, setup):
    root, target = setup
    good = init_random_mtp_draft(target, tmp_path / "good", seed=2)

    def variant(name: str, tensors=None, config=None) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors if tensors is not None else _tensors(good), str(d / "model.safetensors"))
        raw = json.loads((good / "config.json").read_text())
        raw.update(config or {})
        (d / "config.json").write_text(json.dumps(raw))
        return d

    t = _tensors(good)
    missing = variant("missing", {k: v for k, v in t.items() if k != "layers.0.hidden_norm.weight"})
    with pytest.raises(DraftCheckpointError, match=r"missing tensors \['layers.0.hidden_norm"):
        load_mtp_draft(missing)
    narrow = dict(t)
    narrow["layers.0.self_attn.q_proj.weight"] = torch.zeros(64, H)
    with pytest.raises(DraftCheckpointError, match=r"q_proj.weight has shape \[64, 64\].*2 x"):
        load_mtp_draft(variant("narrow", narrow))
    with pytest.raises(DraftCheckpointError, match="reduced draft vocabulary"):
        load_mtp_draft(variant("d2t", {**t, "d2t": torch.zeros(8, dtype=torch.long)}))
    with pytest.raises(DraftCheckpointError, match="unexpected tensors"):
        load_mtp_draft(variant("two-layers", {**t, "layers.1.norm.weight": torch.ones(H)}))
    # fc.weight (SGLang skips it) and the embedding (SGLang shares the target's) are ignored.
    extra = variant("extra", {**t, "fc.weight": torch.zeros(H, 3 * H),
                              "embed_tokens.weight": torch.zeros(V, H)})  # fmt: skip
    assert validate_checkpoint(extra, target) == []
    with pytest.raises(DraftCheckpointError, match="use_aux_hidden_state is not false"):
        load_mtp_draft(variant("aux", config={"eagle_config": {"use_aux_hidden_state": True}}))
    with pytest.raises(DraftCheckpointError, match="draft_vocab_size 32 != vocab_size"):
        load_mtp_draft(variant("dvs", config={"draft_vocab_size": 32}))
    # Target mismatch: vocabulary and hidden size.
    other = make_tiny_target(tmp_path / "other", num_layers=2, vocab_size=128, hidden_size=32)
    with pytest.raises(DraftCheckpointError) as e:
        load_mtp_draft(good, target_config=other)
    assert "hidden_size 64 differs from the target's 32" in str(e.value)
    assert "vocab_size 256 differs from the target vocabulary (128)" in str(e.value)
    assert "does not fit the target" in validate_checkpoint(good, other)[0]
    with pytest.raises(SystemExit) as exit_:
        export_main([str(good), str(tmp_path / "x"), "--target", str(other)])
    assert exit_.value.code == 2
    # Kinds are not confused.
    with pytest.raises(DraftCheckpointError, match="is an MTP-1 draft.*load_mtp_draft"):
        load_draft(good)
    dspark = tmp_path / "dspark"
    from sglang_dspark.drafter.formats.checkpoint import init_random_draft

    init_random_draft(target, dspark, block_size=3, markov_rank=8)
    with pytest.raises(DraftCheckpointError, match="not an MTP draft"):
        load_mtp_draft(dspark)
    # A truncated weights file.
    broken = variant("truncated")
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftCheckpointError, match="truncated"):
        load_mtp_draft(broken)
    # Training options that only DSpark has.
    with pytest.raises(ValueError, match="DSpark-only"):
        build_trainer(_cfg(root, target, "mse", mse_weight=0.5))
    with pytest.raises(ValueError, match="not one of"):
        build_trainer(_cfg(root, target, "kind", drafter="eagle"))


def test_held_out_evaluation_of_an_mtp_run(setup, tmp_path):
    """--eval-data on the MTP-1 trainer: one draft position; the step-0 record is the mean of
    1 - TV/2 over the fixed held-out positions, recomputed per sequence by hand; the
    accept length it implies is 1 + a; records at step 0, every eval_every steps, the end."""
    root, target = setup
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join((root / "data.jsonl").read_text().splitlines()[:5]) + "\n")
    trainer = build_trainer(_cfg(root, target, "mtp-eval", eval_data=str(held), eval_every=4))
    adapter = TargetAdapter.from_pretrained(target, [0])
    acc, n = 0.0, 0
    with torch.no_grad():
        for seq, pos in trainer.eval_plan:
            final = adapter.features(seq.input_ids).final_hidden
            S = seq.input_ids.numel()
            out = trainer.drafter(final[: S - 2], seq.input_ids[1 : S - 1], torch.arange(S - 2))
            p_d = trainer.drafter.logits(out[pos]).softmax(-1)
            p_t = adapter.logits(final[pos + 1]).softmax(-1)
            acc += (1 - 0.5 * (p_d - p_t).abs().sum(-1)).sum().item()
            n += pos.numel()
    trainer.train()
    recs = [json.loads(x) for x in (root / "mtp-eval" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 4, 8]
    assert recs[0]["positions"] == [n] and recs[0]["accept"][0] == pytest.approx(acc / n, abs=1e-4)
    assert recs[0]["tau_estimate"] == pytest.approx(1 + acc / n, abs=1e-4)
    assert recs[-1]["accept"][0] > recs[0]["accept"][0]  # training on the same motifs helps
