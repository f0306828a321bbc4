"""The DeepSeek-V4 DSpark trainer (``--drafter dspark-v4``) on the tiny V4 checkpoint.

- The target adapter's features equal an independent recomputation with transformers'
  modules (each decoder layer run by hand, the output's stream mean) and, in a child
  process, SGLang's own ``mhc_stream_mean`` and target head (``hc_head_torch`` + final norm,
  weights loaded by SGLang's loader) applied to the same streams.
- A short training run on tokenised eval prompts lowers the loss and raises the acceptance
  proxy over the untrained drafter on the same fixed blocks.
- The export loads with SGLang 0.5.23's own loader (every draft parameter filled, no unused
  tensor), as a draft directory and bundled into a target copy, and SGLang's draft modules
  compute what ours do from it: main_proj/main_norm, each stage's context KV (wkv, kv_norm,
  RoPE), query and output paths, hc head, final norm, Markov bias, confidence logit.
- Bad input is refused with a message: a non-V4 target, a V4 config missing fields.

Run as ``python tests/test_drafter_v4.py --child ...`` this file is the SGLang child.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REPO = HERE.parent
EVAL = REPO / "sglang_dspark" / "assets" / "eval"
STEPS = 24


# ============================================================================ child (SGLang)
def _child(draft_dir: str, bundled_dir: str, inputs: str, out: str) -> None:
    """SGLang's loader reports for the draft directory and the bundled copy, and SGLang's
    modules applied to ``inputs``; written to ``out`` (json + safetensors)."""
    sys.path.insert(0, str(HERE))
    import v4_sglang_load as L

    os.environ.update(L._ENV)
    os.environ["SGLANG_DSPARK_FAST_KERNEL"] = "0"  # the draft's torch query / rope paths
    L._set_up_cpu()
    import sglang.srt.model_loader.loader as loader_mod
    from safetensors.torch import load_file, save_file
    from sglang.kernels.ops.layernorm.mhc import mhc_stream_mean
    from sglang.srt.models.deepseek_v4 import hc_head_torch
    from sglang.srt.models.deepseek_v4_dspark import apply_rotary_emb

    built = []
    initialize = loader_mod._initialize_model

    def keep(*args, **kwargs):
        built.append(initialize(*args, **kwargs))
        return built[-1]

    loader_mod._initialize_model = keep
    reports = {
        "draft_dir": L._load(draft_dir, draft=True),
        "bundled_target": L._load(bundled_dir, draft=False),
        "bundled_draft": L._load(bundled_dir, draft=True),
    }
    dm, tm = built[0].float(), built[1].float()
    x = load_file(inputs)
    res: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        # Target: SGLang's capture reduction and head on transformers' layer outputs.
        res["target_context"] = torch.cat(
            [mhc_stream_mean(s) for s in x["layer_streams"].unbind(0)], dim=-1
        )
        m = tm.model
        collapsed = hc_head_torch(x["last_streams"], m.hc_head_fn, m.hc_head_scale,
                                  m.hc_head_base, norm_eps=m.norm.variance_epsilon,
                                  hc_eps=tm.config.hc_eps)  # fmt: skip
        res["target_final"] = m.norm.forward_native(collapsed)
        # Draft modules.
        main_x = dm.project_target_hidden(x["features"])
        res["main_x"] = main_x
        pos, ctx_pos = x["positions"], x["ctx_positions"]
        for s, stage in enumerate(dm.stages):
            attn = stage.self_attn
            rd = attn.rope_head_dim
            kv = attn.kv_norm.forward_native(attn.wkv(main_x)[0])
            apply_rotary_emb(kv[:, None, -rd:], attn.freqs_cis[ctx_pos])
            res[f"ctx_kv.{s}"] = kv
            res[f"q.{s}"] = attn._compute_q(x["stage_input"], pos)
            o = x["attn_o"].clone()
            apply_rotary_emb(o[..., -rd:], attn.freqs_cis[pos], inverse=True)
            o = o.view(o.shape[0], attn.n_local_groups, -1)
            wo_a = attn.wo_a.weight.view(attn.n_local_groups, attn.o_lora_rank, -1)
            o = torch.einsum("bgd,grd->bgr", o.float(), wo_a.float())
            res[f"attn_out.{s}"] = attn.wo_b(o.reshape(o.shape[0], -1))[0]
            # MoE weights where SGLang's fused modules read them: w13 = [gate; up].
            mlp = stage.mlp
            res[f"w13.{s}"] = mlp.experts.w13_weight
            res[f"w2.{s}"] = mlp.experts.w2_weight
            res[f"shared_gate_up.{s}"] = mlp.shared_experts.gate_up_proj.weight
            res[f"router.{s}"] = mlp.gate.weight
            res[f"router_bias.{s}"] = mlp.gate.e_score_correction_bias
            res[f"hc_attn.{s}"] = torch.cat(
                [stage.hc_attn_fn.flatten(), stage.hc_attn_base, stage.hc_attn_scale]
            )
        x_post_hc = dm.collapse_hc_head(x["streams"])
        res["x_post_hc"] = x_post_hc
        res["final_norm"] = dm.stages[-1].norm.forward_native(x_post_hc)
        bias, embed = dm.markov_head(x["prev_tokens"])
        res["markov_bias"] = bias
        res["confidence_raw"] = dm.confidence_head(x_post_hc, embed)
    save_file({k: v.contiguous().float() for k, v in res.items()}, out + ".safetensors")
    Path(out + ".json").write_text(json.dumps(reports))


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(*sys.argv[2:6])
    raise SystemExit(0)


# ============================================================================ fixtures
from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.training.cli import main
from sglang_dspark.drafter.training.config import TrainConfig
from sglang_dspark.drafter.training.registry import build_trainer
from sglang_dspark.drafter.training.target import make_tiny_target

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from sglang_dspark.v4.tiny import build_tiny_v4

    return build_tiny_v4(tmp_path_factory.mktemp("tiny-v4") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory) -> Path:
    """Eval prompts (GSM8K, HumanEval, MT-Bench) tokenised with the target's tokenizer, two
    per sequence (54-192 tokens, so some blocks see a full 128-row window)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    texts = []
    for name in ("gsm8k", "humaneval", "mt-bench"):
        with open(EVAL / f"{name}.jsonl") as f:
            texts += [json.loads(line)["turns"][0] for _, line in zip(range(12), f)]
    path = tmp_path_factory.mktemp("v4-data") / "data.jsonl"
    rows = [tok.encode(a + "\n\n" + b).ids[:192] for a, b in zip(texts[0::2], texts[1::2])]
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return path


def _cfg(tiny, data, out, **kw) -> TrainConfig:
    base = {
        "data": str(data), "target": str(tiny), "out_dir": str(out), "drafter": "dspark-v4",
        "block_size": 5, "markov_rank": 32, "num_anchors": 12, "global_batch_size": 4,
        "steps": STEPS, "lr": 3e-3, "warmup_ratio": 0.1, "precision": "fp32",
        "progress": False, "checkpoint_every": 1000,
    }  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _eval(trainer) -> tuple[float, float]:
    """(loss, acceptance proxy) of the trainer's drafter on fixed blocks: every sequence,
    the anchors of step 0's epoch, no gradient."""
    from sglang_dspark.drafter.training.data import _stable_seed, block_targets, sample_anchor_split
    from sglang_dspark.drafter.training.loss import LossSums, combine

    items = []
    for seq in trainer.sequences:
        full, _ = sample_anchor_split(seq.loss_mask, 12, 0, _stable_seed(7, seq.index))
        empty = full[:0]
        items.append((seq, block_targets(seq, full, 5), block_targets(seq, empty, 5)))
    sums = LossSums.zeros()
    with torch.no_grad():
        for i in range(0, len(items), 4):
            sums = (
                sums + trainer._micro_batch_loss(trainer._micro_batch(items[i : i + 4])).detached()
            )
    loss = combine(sums, trainer.cfg.loss_weights, sums.weight, sums.weight)
    return float(loss), float(sums.accept / sums.count)


@pytest.fixture(scope="module")
def trained(tiny, data, tmp_path_factory):
    """A short run (STEPS steps); the untrained and trained drafters' eval on the same
    blocks; the export."""
    out = tmp_path_factory.mktemp("v4-run")
    trainer = build_trainer(_cfg(tiny, data, out, eval_data=str(data)))
    before = _eval(trainer)
    draft = trainer.train()
    after = _eval(trainer)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"trainer": trainer, "before": before, "after": after, "draft": draft,
            "metrics": metrics}  # fmt: skip


# ============================================================================ (1) target
def test_v4_features_are_stream_means_of_the_captured_layers_outputs(tiny):
    """Independent recomputation: the decoder layers run one by one with the arguments the
    model passes them; H(l) = mean over the mHC streams of layer l's OUTPUT (SGLang's
    capture), for every l in dspark_target_layer_ids [1, 2, 3] (3 is the last layer)."""
    from transformers import DeepseekV4ForCausalLM

    from sglang_dspark.drafter.training.target_v4 import V4TargetAdapter

    model = DeepseekV4ForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    adapter = V4TargetAdapter(model, [1, 2, 3])
    ids = torch.randint(0, 49152, (150,), generator=torch.Generator().manual_seed(0))
    feats = adapter.features(ids)

    base = model.model
    seen = {}
    hook = base.layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    with torch.no_grad():
        ref = model(input_ids=ids[None], use_cache=False, output_hidden_states=True)
    hook.remove()
    streams, outputs = seen["args"][0], []
    with torch.no_grad():
        for layer in base.layers:
            streams = layer(streams, **seen["kwargs"])
            outputs.append(streams[0])
    expected = torch.cat([outputs[i].mean(dim=1) for i in (1, 2, 3)], dim=-1)
    assert feats.context.shape == (150, 3 * 256)
    torch.testing.assert_close(feats.context, expected, rtol=0, atol=0)
    # transformers' own record agrees for the non-final layers (hidden_states[l + 1] is the
    # output of layer l) ...
    torch.testing.assert_close(feats.context[:, :256], ref.hidden_states[2][0].mean(dim=1))
    # ... and the dense convention (the INPUT of layer l) would be another feature.
    assert not torch.allclose(feats.context[:, :256], ref.hidden_states[1][0].mean(dim=1))
    # Final hidden state = norm(hc_head(last streams)); p_t through the LM head.
    torch.testing.assert_close(feats.final_hidden, ref.hidden_states[-1][0])
    torch.testing.assert_close(adapter.logits(feats.final_hidden), ref.logits[0])


def test_a_block_sees_the_128_context_rows_before_its_anchor_in_its_own_sequence(tiny):
    """SGLang's draft window (compute_dspark_window_gather): the last min(a, 128) context
    rows of the block's own request, none at or after the anchor; packed sequences do not
    see each other."""
    from sglang_dspark.drafter.dspark_v4 import DSparkV4Drafter, V4DraftConfig, init_v4_weights
    from sglang_dspark.drafter.model import BlockLayout

    cfg = V4DraftConfig.for_target(json.loads((tiny / "config.json").read_text()))
    drafter = DSparkV4Drafter(cfg).eval()
    init_v4_weights(drafter, seed=0)
    gen = torch.Generator().manual_seed(0)
    V, H = cfg.vocab_size, cfg.hidden_size
    drafter.attach_shared(torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen))
    S0, S1 = 300, 50  # two packed sequences: rows 0..299 and 300..349
    feats = torch.randn(S0 + S1, 3 * H, generator=gen)
    anchors = torch.tensor([200, 20])  # one block per sequence
    layout = BlockLayout(
        block_ids=torch.full((2, cfg.block_size), cfg.mask_token_id),
        positions=anchors[:, None] + torch.arange(cfg.block_size),
        ctx_positions=torch.cat([torch.arange(S0), torch.arange(S1)]),
        ctx_lo=torch.tensor([0, S0]),
        ctx_hi=torch.tensor([200, S0 + 20]),
    )

    def run(rows):
        f = feats.clone()
        f[rows] += 1.0
        with torch.no_grad():
            return drafter(f, layout)

    base = run([])
    same = lambda h, b: torch.equal(h[b], base[b])
    assert same(run(list(range(72))), 0)  # older than the 128-row window (200 - 128 = 72)
    assert not same(run([72]), 0) and not same(run([199]), 0)  # window edges
    assert same(run(list(range(200, S0))), 0)  # the anchor's row and later: never seen
    assert same(run(list(range(S0))), 1)  # sequence 0's rows are not sequence 1's context
    assert not same(run([S0 + 19]), 1) and same(run([S0 + 20]), 1)


# ============================================================================ (2) training
@pytest.mark.slow
def test_a_short_run_lowers_the_loss_and_raises_the_acceptance_proxy(trained):
    (loss0, acc0), (loss1, acc1) = trained["before"], trained["after"]
    assert loss1 < loss0 - 0.1, (loss0, loss1)
    assert acc1 > acc0 + 0.005, (acc0, acc1)
    m = trained["metrics"]
    assert len(m) == STEPS
    first = sum(r["loss"] for r in m[:4]) / 4
    last = sum(r["loss"] for r in m[-4:]) / 4
    assert last < first, (first, last)
    print(f"eval loss {loss0:.4f} -> {loss1:.4f}, accept {acc0:.4f} -> {acc1:.4f}; "
          f"train loss {first:.4f} -> {last:.4f}")  # fmt: skip


@pytest.mark.slow
def test_held_out_curve_of_a_v4_run(trained):
    """--eval-data on the V4 trainer: records at step 0 and at the end, on the same blocks,
    and the trained drafter's per-position acceptance is higher (as on the fixed blocks above)."""
    out = Path(trained["trainer"].out_dir)
    recs = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, STEPS]
    assert recs[0]["positions"] == recs[1]["positions"] and recs[0]["positions"][0] > 0
    mean = [sum(a * n for a, n in zip(r["accept"], r["positions"])) / sum(r["positions"])
            for r in recs]  # fmt: skip
    assert mean[1] > mean[0] + 0.005, mean


# ============================================================================ (3) export
@pytest.fixture(scope="module")
def sglang_side(trained, tiny, tmp_path_factory):
    """Our numbers and SGLang's for the same inputs, and SGLang's loader reports."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    from sglang_dspark.drafter.dspark_v4 import _rope, rope_cos_sin
    from sglang_dspark.drafter.formats.checkpoint_v4 import bundle_v4_draft, load_v4_draft
    from sglang_dspark.drafter.training.target_v4 import V4TargetAdapter

    root = tmp_path_factory.mktemp("v4-sglang")
    bundled = bundle_v4_draft(tiny, trained["draft"], root / "bundled")
    ours = load_v4_draft(trained["draft"]).eval()
    cfg = ours.config
    gen = torch.Generator().manual_seed(1)
    S, N, H = 40, 10, cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size, (S,), generator=gen)
    model = DeepseekV4ForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    layer_out = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _a, o, i=i: layer_out.__setitem__(i, o[0])) for i in range(4)]  # fmt: skip
    feats = V4TargetAdapter(model, cfg.target_layer_ids).features(ids)
    for h in hooks:
        h.remove()
    x = {
        "layer_streams": torch.stack([layer_out[i] for i in cfg.target_layer_ids]),
        "last_streams": layer_out[3],
        "features": feats.context,
        "ctx_positions": torch.arange(S),
        "positions": torch.arange(N) + 30,
        "stage_input": torch.randn(N, H, generator=gen),
        "attn_o": torch.randn(N, 8, 512, generator=gen),
        "streams": torch.randn(N, cfg.hc_mult, H, generator=gen),
        "prev_tokens": torch.randint(0, cfg.vocab_size, (N,), generator=gen),
    }
    save_file({k: v.contiguous() for k, v in x.items()}, str(root / "inputs.safetensors"))
    out = str(root / "sglang")
    child = subprocess.run(
        [sys.executable, __file__, "--child", str(trained["draft"]), str(bundled),
         str(root / "inputs.safetensors"), out],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-6000:]
    theirs = load_file(out + ".safetensors")
    reports = json.loads(Path(out + ".json").read_text())

    mine: dict[str, torch.Tensor] = {"target_context": feats.context,
                                     "target_final": feats.final_hidden}  # fmt: skip
    with torch.no_grad():
        main_x = ours.project_context(x["features"])
        mine["main_x"] = main_x
        cos_c, sin_c = rope_cos_sin(x["ctx_positions"], cfg.rope_head_dim, cfg.rope_theta)
        cos_q, sin_q = rope_cos_sin(x["positions"], cfg.rope_head_dim, cfg.rope_theta)
        for s, layer in enumerate(ours.layers):
            a = layer.self_attn
            mine[f"ctx_kv.{s}"] = _rope(a.kv_norm(a.kv_proj(main_x)), cos_c, sin_c)
            q = a.q_b_proj(a.q_a_norm(a.q_a_proj(x["stage_input"]))).view(N, -1, a.head_dim)
            mine[f"q.{s}"] = _rope(a.q_b_norm(q), cos_q, sin_q)
            o = _rope(x["attn_o"], cos_q, -sin_q)
            mine[f"attn_out.{s}"] = a.o_b_proj(a.o_a_proj(o.reshape(N, 2, -1)).flatten(1))
            mlp = layer.mlp
            mine[f"w13.{s}"] = mlp.experts.gate_up_proj
            mine[f"w2.{s}"] = mlp.experts.down_proj
            mine[f"shared_gate_up.{s}"] = torch.cat(
                [mlp.shared_experts.gate_proj.weight, mlp.shared_experts.up_proj.weight]
            )
            mine[f"router.{s}"] = mlp.gate.weight
            mine[f"router_bias.{s}"] = mlp.gate.e_score_correction_bias
            hc = layer.attn_hc
            mine[f"hc_attn.{s}"] = torch.cat([hc.fn.flatten(), hc.base, hc.scale])
        x_post_hc = ours.hc_head(x["streams"][None])[0]  # [B, S, hc, H] in transformers
        mine["x_post_hc"] = x_post_hc
        mine["final_norm"] = ours.norm(x_post_hc)
        mine["markov_bias"] = ours.markov_head.block_bias(x["prev_tokens"], x_post_hc)
        mine["confidence_raw"] = ours.confidence_logits(x_post_hc[None], x["prev_tokens"][None])[0]
    return {"reports": reports, "ours": mine, "theirs": theirs}


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_loads_the_export_filling_every_draft_parameter(sglang_side, trained):
    from safetensors.torch import load_file

    exported = load_file(str(Path(trained["draft"]) / "model.safetensors"))
    assert exported and all(n.startswith("mtp.") for n in exported)
    reports = sglang_side["reports"]
    for key in ("draft_dir", "bundled_draft"):
        r = reports[key]
        assert r["architecture"] == "DeepseekV4ForCausalLMDSpark"
        assert r["untouched"] == [] and r["warnings"] == [], (
            key,
            r["untouched"][:5],
            r["warnings"][:5],
        )
        assert r["dtype_mismatch"] == [] and r["dtype_checked"] > 30
        assert {n for n in r["read"] if n.startswith("mtp.")} == set(exported)
        params = r["params"]
        assert {n.split(".")[1] for n in params if n.startswith("stages.")} == {"0", "1", "2"}
        assert params["confidence_head.proj.weight"][0] == [1, 256 + 32]
    t = reports["bundled_target"]
    assert t["architecture"] == "DeepseekV4ForCausalLM"
    assert t["untouched"] == [] and t["warnings"] == [] and t["dtype_mismatch"] == []
    cfg = json.loads((Path(trained["draft"]) / "config.json").read_text())
    assert cfg["dspark_target_layer_ids"] == [1, 2, 3] and cfg["dspark_markov_rank"] == 32
    assert cfg["dspark_block_size"] == 5 and cfg["architectures"] == ["DeepseekV4ForCausalLM"]


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize(
    "name",
    ["target_context", "target_final", "main_x", "ctx_kv.0", "ctx_kv.2", "q.0", "q.1",
     "attn_out.0", "attn_out.2", "w13.0", "w2.1", "shared_gate_up.2", "router.0",
     "router_bias.1", "hc_attn.2", "x_post_hc", "final_norm", "markov_bias",
     "confidence_raw"],
)  # fmt: skip
def test_sglangs_modules_compute_what_ours_do_from_the_export(sglang_side, name):
    ours, theirs = sglang_side["ours"][name].float(), sglang_side["theirs"][name]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=2e-4, atol=2e-4)


def test_the_export_round_trips_and_bundles_back_into_the_target(tiny, tmp_path):
    """--init-draft reads the tiny checkpoint's bundled draft; our export of it carries the
    same tensors under the same names."""
    from safetensors.torch import load_file

    from sglang_dspark.drafter.formats.checkpoint_v4 import load_v4_draft, save_v4_draft

    drafter = load_v4_draft(tiny)
    save_v4_draft(drafter, tmp_path / "draft")
    src = {k: v for k, v in load_file(str(tiny / "model.safetensors")).items()
           if k.startswith("mtp.")}  # fmt: skip
    out = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert set(out) == set(src)
    for k, t in src.items():
        assert out[k].dtype == t.dtype and torch.equal(out[k], t), k

    # sglang-dspark bundle-v4-draft: the target's own tensors, the draft's mtp.* ones.
    from sglang_dspark.cli import main as cli

    assert cli(["bundle-v4-draft", "--target", str(tiny), "--draft", str(tmp_path / "draft"),
                "--out", str(tmp_path / "bundled")]) == 0  # fmt: skip
    bundled = load_file(str(tmp_path / "bundled" / "model.safetensors"))
    target = load_file(str(tiny / "model.safetensors"))
    assert set(bundled) == set(target)
    assert all(torch.equal(bundled[k], target[k]) for k in target)
    assert (tmp_path / "bundled" / "tokenizer.json").is_file()
    assert cli(["bundle-v4-draft", "--target", str(tiny), "--draft", str(tmp_path / "draft"),
                "--out", str(tiny)]) != 0  # fmt: skip


# ============================================================================ (4) refusals
def test_a_non_v4_target_is_refused(tmp_path, data, capsys):
    target = make_tiny_target(tmp_path / "llama", num_layers=4)
    with pytest.raises(DraftConfigError, match="not DeepSeek-V4.*--drafter dspark"):
        build_trainer(_cfg(target, data, tmp_path / "run"))
    with pytest.raises(SystemExit) as exc:  # the CLI: exit status 2 and the message
        main(["--drafter", "dspark-v4", "--target", str(target), "--data", str(data),
              "--out-dir", str(tmp_path / "run2")])  # fmt: skip
    assert exc.value.code == 2
    assert "not DeepSeek-V4" in capsys.readouterr().err


def test_a_v4_target_without_the_needed_config_fields_is_refused(tiny, data, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    for key in ("hc_mult", "o_groups", "qk_rope_head_dim"):
        del cfg[key]
    (broken / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(tiny / "model.safetensors", broken / "model.safetensors")
    with pytest.raises(
        DraftConfigError, match=r"lacks \['qk_rope_head_dim', 'o_groups', 'hc_mult'\]"
    ):
        build_trainer(_cfg(broken, data, tmp_path / "run"))


def test_bad_v4_draft_options_are_refused(tiny, data, tmp_path):
    with pytest.raises(DraftConfigError, match="outside 0..3"):
        build_trainer(_cfg(tiny, data, tmp_path / "a", target_layer_ids=[1, 4]))
    with pytest.raises(DraftConfigError, match="vanilla Markov head only"):
        build_trainer(_cfg(tiny, data, tmp_path / "b", markov_head_type="rnn"))
    with pytest.raises(DraftConfigError, match="mse_weight / dense_anchors"):
        build_trainer(_cfg(tiny, data, tmp_path / "c", mse_weight=0.1))
