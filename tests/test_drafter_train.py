"""Training: block targets, anchors, resume after interruption, torchrun (2 CPU ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_dspark.drafter.training.cli import main
from sglang_dspark.drafter.training.config import TrainConfig
from sglang_dspark.drafter.training.data import (
    TokenSequence,
    anchor_candidates,
    block_targets,
    load_sequences,
    sample_anchor_split,
    sample_anchors,
)
from sglang_dspark.drafter.training.target import make_tiny_target
from sglang_dspark.drafter.training.train import Trainer

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(root / "target", num_layers=4)
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for i in range(24):
            n, p = rng.randint(16, 48), rng.randint(2, 8)
            # A learnable pattern: the response repeats a short motif.
            motif = [rng.randrange(256) for _ in range(3)]
            ids = [rng.randrange(256) for _ in range(p)] + [motif[j % 3] for j in range(n - p)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)}) + "\n")
    return root, target


def _cfg(root: Path, target: Path, out: str, **kw) -> TrainConfig:
    base = {
        "data": str(root / "data.jsonl"),
        "target": str(target),
        "out_dir": str(root / out),
        "block_size": 4,
        "num_layers": 1,
        "markov_rank": 16,
        "target_layer_ids": [0, 2],
        "num_anchors": 6,
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "steps": 8,
        "checkpoint_every": 3,
        "lr": 2e-3,
        "warmup_ratio": 0.25,
        "precision": "fp32",
        "export_dtype": "float32",
        "progress": False,
        "seed": 7,
    }
    base.update(kw)
    return TrainConfig(**base)


def _blocks(drafter, mb) -> torch.Tensor:
    """h_1..h_gamma [B, gamma, H] of a micro-batch's real blocks (its layout is batched)."""
    return drafter(mb.context, mb.layout).flatten(0, 1)[mb.rows]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "draft" / "model.safetensors"))


# ------------------------------------------------------------------ data and anchors
def test_block_targets_by_hand():
    ids = torch.arange(10, 20)  # token at position i is 10 + i
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    seq = TokenSequence(ids, mask)
    assert anchor_candidates(mask).tolist() == [2, 3, 4, 5, 8]
    bt = block_targets(seq, torch.tensor([2, 5, 8]), block_size=3)
    assert bt.labels.tolist() == [[13, 14, 15], [16, 17, 18], [19, 19, 19]]
    assert bt.prev_tokens.tolist() == [[12, 13, 14], [15, 16, 17], [18, 19, 19]]
    # Block at 5: position 7 is off the loss mask, so 7 and everything after are unsupervised.
    assert bt.valid.tolist() == [[True] * 3, [True, False, False], [True, False, False]]
    assert bt.target_pos.tolist() == [[2, 3, 4], [5, 6, 7], [8, 8, 8]]


def test_anchor_sampling_is_seeded_and_valid():
    mask = torch.tensor([0] * 5 + [1] * 40, dtype=torch.bool)
    a = sample_anchors(mask, 8, seed=1)
    assert a.tolist() == sample_anchors(mask, 8, seed=1).tolist()
    assert a.tolist() != sample_anchors(mask, 8, seed=2).tolist()
    assert len(set(a.tolist())) == 8 and min(a.tolist()) >= 5 and max(a.tolist()) <= 43
    assert sample_anchors(mask, 100, seed=1).numel() == 39


def test_dense_anchors_leave_the_full_ones_alone():
    mask = torch.tensor([0] * 5 + [1] * 40, dtype=torch.bool)
    full, dense = sample_anchor_split(mask, 8, 20, seed=1)
    assert full.tolist() == sample_anchors(mask, 8, seed=1).tolist()
    assert dense.numel() == 20 and not set(full.tolist()) & set(dense.tolist())
    full, dense = sample_anchor_split(mask, 30, 20, seed=1)  # only 39 candidates
    assert full.numel() == 30 and dense.numel() == 9


def test_data_format_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}\n')
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 input_ids"):
        load_sequences(p, max_length=16)
    p.write_text('{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]}\n')
    (seq,) = load_sequences(p, max_length=16)
    assert seq.loss_mask.tolist() == [False, False, True, True, True]


def test_out_of_vocab_data_is_refused(setup, tmp_path):
    root, target = setup
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(json.dumps({"input_ids": [1, 2, 300, 4]}) for _ in range(4)))
    with pytest.raises(ValueError, match="token id 300 outside the target vocabulary"):
        Trainer(_cfg(root, target, "bad", data=str(p)))


# ------------------------------------------------------------------ training
def test_dense_mse_blocks_train_and_need_a_weight(setup):
    """Dense blocks (centred-logit MSE only) lower that MSE; the full-loss blocks are the
    same ones as without them; dense blocks without an MSE weight are refused."""
    root, target = setup
    with pytest.raises(ValueError, match="dense_anchors=4 needs mse_weight > 0"):
        Trainer(_cfg(root, target, "dense-bad", dense_anchors=4))
    trainer = Trainer(
        _cfg(root, target, "dense", steps=30, checkpoint_every=100, lr=3e-3, dense_anchors=6,
             mse_weight=0.5)
    )  # fmt: skip
    plain = Trainer(_cfg(root, target, "dense-ref", steps=30, checkpoint_every=100))
    for (_, a, dense), (_, b, none) in zip(trainer._plan(0), plain._plan(0)):
        assert a.anchors.tolist() == b.anchors.tolist() and none.anchors.numel() == 0
        assert dense.anchors.numel() > 0
    first = trainer.train_step()
    for _ in range(28):
        trainer.train_step()
    last = trainer.train_step()
    assert last.per_term["mse"] < 0.8 * first.per_term["mse"]
    assert last.loss < first.loss


def test_training_lowers_the_loss(setup):
    root, target = setup
    trainer = Trainer(_cfg(root, target, "learn", steps=30, checkpoint_every=100, lr=3e-3))
    first = trainer.train_step()
    for _ in range(28):
        trainer.train_step()
    last = trainer.train_step()
    assert last.loss < 0.8 * first.loss
    assert 0.0 <= last.accept <= 1.0 and last.tokens > 0


def test_feature_cache_runs_the_target_once_per_sequence_and_changes_nothing(setup):
    """12 steps of 4 over 24 sequences = 2 epochs: the cached run runs the target over 24
    sequences (not 48), one batched forward per micro-batch, and ends with the weights of the
    uncached run."""
    root, target = setup
    runs = {}
    for name, gb in (("cached", 1.0), ("uncached", 0.0)):
        trainer = Trainer(
            _cfg(root, target, name, steps=12, checkpoint_every=100, feature_cache_gb=gb)
        )
        calls = []

        def counted(ids, *a, _calls=calls, _original=trainer.target.features, **k):
            _calls.append(ids.shape[0])
            return _original(ids, *a, **k)

        trainer.target.features = counted
        runs[name] = (_weights(trainer.train().parent), calls)
    (cached, n_cached), (uncached, n_uncached) = runs["cached"], runs["uncached"]
    assert sum(n_cached) == 24 and sum(n_uncached) == 48
    assert n_cached == [24]  # one length-sorted group (target_batch_size 32) fills the cache
    assert max(n_uncached) == 2  # micro_batch_size sequences per target forward
    # Padding to another length may move the last bits of a float32 forward; nothing more.
    for k in cached:
        torch.testing.assert_close(cached[k], uncached[k], rtol=1e-4, atol=1e-6)


def test_a_run_within_one_epoch_caches_nothing(setup, caplog):
    """6 steps of 4 over 24 sequences read each once: with a cache budget the target still runs
    per micro-batch over what the step reads (no group computed ahead), nothing is held, and the
    log says why."""
    root, target = setup
    trainer = Trainer(_cfg(root, target, "one-epoch", steps=6, feature_cache_gb=1.0))
    calls = []

    def counted(ids, *a, _original=trainer.target.features, **k):
        calls.append(ids.shape[0])
        return _original(ids, *a, **k)

    trainer.target.features = counted
    with caplog.at_level("INFO"):
        trainer.train()
    assert calls == [2] * 12 and not trainer._features_cache
    assert "feature cache: off, 6 steps of 4 read each of the 24 sequences" in caplog.text


def test_resume_matches_uninterrupted_run(setup):
    """8 steps, checkpoint every 3; stop after 5 (step 4-5 lost), resume, finish."""
    root, target = setup
    full = Trainer(_cfg(root, target, "full")).train()
    cfg = _cfg(root, target, "resumed", stop_after=5)
    assert Trainer(cfg).train().name == "latest.pt"
    resumed = Trainer(dataclasses.replace(cfg, stop_after=None))
    assert resumed.step == 3  # the last checkpoint, not step 5
    out = resumed.train()
    a, b = _weights(full.parent), _weights(out.parent)
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = (out.parent / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 9))  # lost steps redone once


def _run(args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
    )


def _write_config(cfg: TrainConfig, path: Path) -> Path:
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    return path


@pytest.mark.slow
def test_kill_9_then_resume(setup):
    root, target = setup
    cfg = _cfg(root, target, "killed", steps=400, checkpoint_every=2)
    cfg_file = _write_config(cfg, root / "killed.json")
    ckpt = Path(cfg.out_dir) / "checkpoints" / "latest.pt"
    proc = _run(
        [sys.executable, "-m", "sglang_dspark.drafter.training.train", "--config", str(cfg_file)]
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ckpt.exists():
        time.sleep(0.2)
    time.sleep(1.0)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = torch.load(ckpt, weights_only=True)["step"]
    assert 2 <= step < 400  # latest.pt is whole even if the kill hit a checkpoint write
    # Resume in-process and finish early, then compare with a fresh run to the same step.
    end = step + 4
    resumed = Trainer(dataclasses.replace(cfg, steps=400, stop_after=4))
    assert resumed.step == step
    resumed.train()
    fresh = Trainer(dataclasses.replace(cfg, out_dir=str(root / "fresh"), stop_after=end))
    fresh.train()
    a, b = resumed.drafter.state_dict(), fresh.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_torchrun_two_ranks_equals_one(setup):
    root, target = setup
    one = _cfg(root, target, "one", steps=4)
    two = dataclasses.replace(one, out_dir=str(root / "two"))
    p1 = _run(
        [
            sys.executable,
            "-m",
            "sglang_dspark.drafter.training.train",
            "--config",
            str(_write_config(one, root / "one.json")),
        ]
    )
    out1 = p1.communicate(timeout=300)[0]
    assert p1.returncode == 0, out1
    p2 = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "sglang_dspark.drafter.training.train",
            "--config",
            str(_write_config(two, root / "two.json")),
        ]
    )
    out2 = p2.communicate(timeout=300)[0]
    assert p2.returncode == 0, out2
    a, b = _weights(Path(one.out_dir)), _weights(Path(two.out_dir))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    m1 = [json.loads(x) for x in (Path(one.out_dir) / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (Path(two.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m1] == [x["step"] for x in m2]
    for x, y in zip(m1, m2):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["tokens"] == y["tokens"]


def test_cli_reports_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--data", "/nonexistent.jsonl"])
    assert e.value.code == 2
    assert "--target" in capsys.readouterr().err


def test_cli_flags_train_and_export(setup, capsys):
    root, target = setup
    out = root / "cli"
    args = ["--data", str(root / "data.jsonl"), "--target", str(target), "--out-dir", str(out),
            "--steps", "2", "--block-size", "3", "--markov-rank", "8", "--num-anchors", "4",
            "--global-batch-size", "2", "--target-layer-ids", "0,2", "--precision", "fp32",
            "--no-progress", "--markov-head-type", "gated"]  # fmt: skip
    assert main(args) == 0
    raw = json.loads((out / "draft" / "config.json").read_text())
    assert raw["block_size"] == 3 and raw["markov_head_type"] == "gated"
    assert raw["target_layer_ids"] == [0, 2]
    assert str(out / "draft") in capsys.readouterr().out


def test_bf16_autocast_step_is_close_to_fp32(setup):
    root, target = setup
    s32 = Trainer(_cfg(root, target, "p32", precision="fp32")).train_step()
    s16 = Trainer(_cfg(root, target, "p16", precision="bf16")).train_step()
    assert s16.loss == pytest.approx(s32.loss, rel=0.05)
    assert torch.isfinite(torch.tensor(s16.grad_norm))


def test_training_can_start_from_an_existing_draft(setup):
    from sglang_dspark.drafter.formats.checkpoint import init_random_draft, load_draft

    root, target = setup
    start = init_random_draft(target, root / "start", block_size=3, markov_rank=8, seed=5)
    out = Trainer(_cfg(root, target, "from_draft", init_draft=str(start), steps=2)).train()
    before, after = load_draft(start), load_draft(out)
    assert after.config.block_size == 3 and after.config.target_layer_ids == [0, 1, 2]
    assert not torch.equal(before.fc.weight, after.fc.weight)  # it trained


def test_draft_layers_can_start_from_target_layers(setup):
    from sglang_dspark.drafter.config import DraftConfigError

    root, target = setup
    trainer = Trainer(
        _cfg(root, target, "from_target", num_layers=2, init_layers_from_target=[3, 1])
    )
    draft, tgt = trainer.drafter.layers, trainer.target.layers
    for i, t in enumerate([3, 1]):
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight"):  # fmt: skip
            torch.testing.assert_close(
                draft[i].get_parameter(name), tgt[t].get_parameter(name).float()
            )
    # q_norm / k_norm have no counterpart in a Llama target: they keep their init
    assert torch.equal(
        draft[0].self_attn.q_norm.weight, torch.ones_like(draft[0].self_attn.q_norm.weight)
    )
    random_start = Trainer(_cfg(root, target, "random_start", num_layers=2)).drafter.layers
    assert not torch.equal(random_start[0].mlp.up_proj.weight, draft[0].mlp.up_proj.weight)
    with pytest.raises(DraftConfigError, match="one target layer index per draft layer"):
        Trainer(_cfg(root, target, "bad1", num_layers=2, init_layers_from_target=[3]))
    with pytest.raises(DraftConfigError, match="target layer 9 does not exist"):
        Trainer(_cfg(root, target, "bad2", init_layers_from_target=[9]))


def test_dflash_holds_the_markov_bias_at_zero_through_training_and_resume(setup):
    """The DFlash baseline trains the backbone (and the confidence head's W1) while B_k stays
    exactly 0, also after an interruption; its export is a DSpark draft whose Markov head adds
    nothing, so SGLang serves the backbone's drafts alone. MTP-1 has no head to switch off."""
    from sglang_dspark.drafter.config import DraftConfigError
    from sglang_dspark.drafter.formats.checkpoint import load_draft

    root, target = setup
    Trainer(_cfg(root, target, "dflash", dflash=True, stop_after=4)).train()  # interrupted
    trainer = Trainer(_cfg(root, target, "dflash", dflash=True))
    assert trainer.step == 3  # resumed from the step-3 checkpoint
    assert not trainer.drafter.markov_head.markov_w2.weight.requires_grad
    out = trainer.train()
    weights = _weights(out.parent)
    assert torch.count_nonzero(weights["markov_head.markov_w2.weight"]) == 0
    dspark = _weights(Trainer(_cfg(root, target, "dflash-ref")).train().parent)
    assert torch.count_nonzero(dspark["markov_head.markov_w2.weight"]) > 0
    for name in ("fc.weight", "markov_head.markov_w1.weight"):  # both still train
        assert not torch.equal(weights[name], dspark[name])
    drafter = load_draft(out, target_config=trainer.target.config)
    drafter.attach_shared(trainer.target.embed_weight, trainer.target.lm_head_weight)
    hidden = torch.randn(2, 4, drafter.config.hidden_size)
    prev = torch.randint(0, 256, (2, 4))
    torch.testing.assert_close(drafter.draft_logits(hidden, prev), drafter.base_logits(hidden))
    with pytest.raises(DraftConfigError, match="MTP-1 has none"):
        from sglang_dspark.drafter.training.registry import build_trainer

        build_trainer(_cfg(root, target, "dflash-mtp", drafter="mtp", dflash=True))


def test_target_top_k_supervision(setup, tmp_path):
    """With the target's top-k (k = the whole vocabulary) a run ends where the full-logit run
    does; with a small k the steps never call the target's LM head (its top-k comes with the
    features, once per sequence) and the loss still falls; the store keeps the top-k apart."""
    root, target = setup
    full = _weights(Trainer(_cfg(root, target, "topk-ref", feature_cache_gb=1.0)).train().parent)
    vocab = Trainer(_cfg(root, target, "topk-probe", steps=1)).draft_config.vocab_size
    exact = Trainer(_cfg(root, target, "topk-all", target_topk=vocab, feature_cache_gb=1.0))
    weights = _weights(exact.train().parent)
    for name, value in full.items():
        torch.testing.assert_close(weights[name], value, rtol=2e-3, atol=2e-5)

    store = tmp_path / "store"
    trainer = Trainer(_cfg(root, target, "topk-8", target_topk=8, steps=12, checkpoint_every=100,
                           feature_store=str(store)))  # fmt: skip
    calls = []
    original = trainer.target.logits
    trainer.target.logits = lambda h: calls.append(h.shape[0]) or original(h)
    trainer.train()
    first = [json.loads(line) for line in (root / "topk-8" / "metrics.jsonl").open()]
    assert first[-1]["loss"] < first[0]["loss"]
    # The LM head ran once per token of the data (the top-k, with the features), never in a step.
    assert sum(calls) == sum(seq.input_ids.numel() for seq in trainer.sequences)
    (key_dir,) = store.iterdir()
    stored = load_file(str(next(key_dir.iterdir())))
    assert (
        stored["topk_ids"].shape[-1] == 8 and stored["topk_logp"].shape == stored["topk_ids"].shape
    )
    with pytest.raises(Exception, match="target_topk is -1"):
        Trainer(_cfg(root, target, "topk-bad", target_topk=-1))


def test_feature_store_shares_target_features_between_runs(setup, tmp_path):
    """A second run on the same store never calls the target and ends with the weights of a
    run without it; another capture list gets its own key; a corrupt file is recomputed."""
    root, target = setup
    store = tmp_path / "store"
    results = {}
    for name, kw in (("plain", {}), ("first", {"feature_store": str(store)}),
                     ("second", {"feature_store": str(store)})):  # fmt: skip
        trainer = Trainer(_cfg(root, target, f"fs-{name}", steps=4, checkpoint_every=100,
                               feature_cache_gb=0.0, **kw))  # fmt: skip
        calls = []

        def counted(ids, *a, _calls=calls, _original=trainer.target.features, **k):
            _calls.append(1)
            return _original(ids, *a, **k)

        trainer.target.features = counted
        results[name] = (_weights(trainer.train().parent), len(calls))
    assert results["first"][1] == results["plain"][1] > 0
    assert results["second"][1] == 0
    for name in ("first", "second"):
        assert all(torch.equal(results[name][0][k], v) for k, v in results["plain"][0].items())
    (key_dir,) = store.iterdir()
    files = sorted(key_dir.glob("*.safetensors"))
    assert len(files) == 16  # 4 steps x 4 sequences, all distinct at seed 7 over 24
    files[0].write_bytes(b"not a safetensors file")
    other = Trainer(_cfg(root, target, "fs-other", steps=1, target_layer_ids=[1, 2],
                         feature_store=str(store)))  # fmt: skip
    other.train()
    assert len(list(store.iterdir())) == 2  # its own key
    again = Trainer(_cfg(root, target, "fs-again", steps=4, checkpoint_every=100,
                         feature_cache_gb=0.0, feature_store=str(store)))  # fmt: skip
    again.train()
    assert again._store.misses == 1 and again._store.hits == 15


# ------------------------------------------------------------------ devices
def test_device_resolution_and_refusals(monkeypatch):
    from sglang_dspark.drafter.config import DraftConfigError
    from sglang_dspark.drafter.training.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DraftConfigError, match="sees no CUDA device.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(DraftConfigError, match="cpu or cuda"):
        resolve_device("meta")
    with pytest.raises(DraftConfigError, match="not a device"):
        resolve_device("gpu0")
    # With CUDA: auto and a bare "cuda" mean this rank's device (LOCAL_RANK under torchrun).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(DraftConfigError, match="2 CUDA devices"):
        resolve_device("cuda:2")


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{prefix}.{f.name}")


@pytest.mark.parametrize("kind", ["dspark", "dspark-topk", "dspark-mse", "mtp"])
def test_every_micro_batch_tensor_moves_to_the_training_device(setup, kind):
    """What a step hands the drafter is moved as a whole (``to_device``): no tensor of a
    micro-batch (layout, labels, teacher logits or top-k, MSE targets) stays behind. Checked
    with the meta device, which any CPU torch has; the CPU path itself copies nothing."""
    from sglang_dspark.drafter.training.registry import build_trainer
    from sglang_dspark.drafter.training.runtime import to_device

    root, target = setup
    kw = {"dspark-topk": {"target_topk": 8}, "dspark-mse": {"dense_anchors": 3, "mse_weight": 0.1},
          "mtp": {"drafter": "mtp"}}.get(kind, {})  # fmt: skip
    tr = build_trainer(_cfg(root, target, f"mb-{kind}", **kw))
    assert tr.device == torch.device("cpu")
    mb = tr._micro_batch(tr._plan(0)[:2])
    found = dict(_tensors(mb))
    assert len(found) >= 5, found.keys()
    assert to_device(mb, torch.device("cpu")).labels is mb.labels  # nothing copied on the CPU
    moved = dict(_tensors(to_device(mb, torch.device("meta"))))
    assert moved.keys() == found.keys()
    assert {name: t.device.type for name, t in moved.items()} == dict.fromkeys(found, "meta")
    assert [f.name for f in dataclasses.fields(mb)] == [
        f.name for f in dataclasses.fields(to_device(mb, torch.device("meta")))
    ]


def test_explicit_cpu_device_trains_the_same_weights_as_auto(setup):
    root, target = setup
    a = Trainer(_cfg(root, target, "dev-auto", steps=3)).train()
    b = Trainer(_cfg(root, target, "dev-cpu", steps=3, device="cpu")).train()
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cuda_device_without_cuda_stops_before_the_target_loads(setup, monkeypatch, capsys):
    from sglang_dspark.drafter.config import DraftConfigError

    root, target = setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DraftConfigError, match="sees no CUDA device"):
        Trainer(_cfg(root, target, "dev-cuda", steps=1, device="cuda"))
    cfg = _cfg(root, target, "dev-cuda-cli", steps=1)
    path = _write_config(cfg, root / "dev-cuda.json")
    with pytest.raises(SystemExit) as e:
        main(["--config", str(path), "--device", "cuda:0"])
    assert e.value.code == 2 and "--device cpu" in capsys.readouterr().err


def test_time_limit_exports_at_a_step_boundary_and_resumes(setup):
    """--time-limit-s: stop after the step that crosses the limit, checkpoint, export; a rerun
    with the same out dir continues to the planned steps exactly as an unboxed run."""
    root, target = setup
    boxed = Trainer(_cfg(root, target, "boxed", steps=6, time_limit_s=0.0))
    out = boxed.train()
    assert boxed.step == 1 and (out / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (root / "boxed" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1] and rows[0]["elapsed_s"] > 0
    resumed = Trainer(_cfg(root, target, "boxed", steps=6))
    assert resumed.step == 1
    resumed.train()
    straight = Trainer(_cfg(root, target, "unboxed", steps=6)).train()
    a, b = _weights(root / "boxed"), load_file(str(straight / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_the_running_step_and_resumes_exactly(setup, monkeypatch, capsys):
    """SIGTERM mid-step (a pod evicted): the step finishes, a checkpoint of it is saved (not
    the one of 3 steps before), the CLI exits 128 + 15 with the handlers restored, and a rerun
    continues to the planned steps exactly as an uninterrupted run."""
    root, target = setup
    cfg = _cfg(root, target, "sigterm", steps=6, checkpoint_every=3)
    path = _write_config(cfg, root / "sigterm.json")
    step_once = Trainer.train_step

    def step_then_signal(self):
        if self.step == 4:  # the 5th step: the last checkpoint was step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return step_once(self)

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["--config", str(path)]) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    ckpt = Path(cfg.out_dir) / "checkpoints" / "latest.pt"
    assert torch.load(ckpt, weights_only=True)["step"] == 5
    assert str(ckpt) in capsys.readouterr().out
    monkeypatch.setattr(Trainer, "train_step", step_once)
    resumed = Trainer(cfg)
    assert resumed.step == 5
    resumed.train()
    straight = Trainer(_cfg(root, target, "sigterm-straight", steps=6)).train()
    a, b = _weights(root / "sigterm"), load_file(str(straight / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (root / "sigterm" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 7))  # no step lost, none redone


def test_grown_drafter_computes_the_loaded_function_then_trains_its_new_layer(setup):
    """grow_layers appends copies of the last layer with zeroed output projections: the
    grown drafter's logits equal the loaded drafter's exactly; training then moves them."""
    from sglang_dspark.drafter.config import DraftConfigError
    from sglang_dspark.drafter.formats.checkpoint import init_random_draft, load_draft

    root, target = setup
    start = init_random_draft(target, root / "grow-start", block_size=4, markov_rank=8, seed=3)
    trainer = Trainer(_cfg(root, target, "grown", init_draft=str(start), grow_layers=2, steps=3))
    assert trainer.draft_config.num_hidden_layers == 3 and len(trainer.drafter.layers) == 3
    loaded = load_draft(start).float()
    loaded.attach_shared(trainer.target.embed_weight, trainer.target.lm_head_weight)
    mb = trainer._micro_batch(trainer._plan(0)[:2])
    with torch.no_grad():
        want = loaded.draft_logits(_blocks(loaded, mb), mb.prev_tokens)
        got = trainer.drafter.draft_logits(_blocks(trainer.drafter, mb), mb.prev_tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    out = trainer.train()
    grown = load_draft(out)
    assert grown.config.num_hidden_layers == 3
    assert grown.layers[2].mlp.down_proj.weight.abs().sum() > 0  # the new layer trained
    # resume keeps the grown shape (the checkpoint's draft config is the grown one)
    again = Trainer(_cfg(root, target, "grown", init_draft=str(start), grow_layers=2, steps=4))
    assert again.step == 3
    with pytest.raises(DraftConfigError, match="--init-draft"):
        Trainer(_cfg(root, target, "grow-bad", grow_layers=1))


def test_markov_rank_grows_without_changing_the_drafts_or_confidences(setup):
    from sglang_dspark.drafter.config import DraftConfigError
    from sglang_dspark.drafter.formats.checkpoint import init_random_draft, load_draft

    root, target = setup
    start = init_random_draft(target, root / "rank-start", block_size=4, markov_rank=8, seed=3)
    trainer = Trainer(_cfg(root, target, "rank-grown", init_draft=str(start),
                           grow_markov_rank=20, steps=3))  # fmt: skip
    d = trainer.drafter
    assert d.markov_head.markov_w1.weight.shape[1] == 20 and d.config.markov_rank == 20
    loaded = load_draft(start).float()
    loaded.attach_shared(trainer.target.embed_weight, trainer.target.lm_head_weight)
    mb = trainer._micro_batch(trainer._plan(0)[:2])
    with torch.no_grad():
        h0, h1 = _blocks(loaded, mb), _blocks(d, mb)
        torch.testing.assert_close(
            d.draft_logits(h1, mb.prev_tokens),
            loaded.draft_logits(h0, mb.prev_tokens),
            rtol=0,
            atol=0,
        )
        # The confidence head's input grows by zero columns: the same sum, in another
        # blocking of the float32 reduction (a few ulp).
        torch.testing.assert_close(d.confidence_logits(h1, mb.prev_tokens),
                                   loaded.confidence_logits(h0, mb.prev_tokens), rtol=0, atol=1e-6)  # fmt: skip
    grown = load_draft(trainer.train())
    assert grown.config.markov_rank == 20
    assert grown.markov_head.markov_w2.weight[:, 8:].abs().sum() > 0  # the new columns trained
    with pytest.raises(DraftConfigError, match="only grows"):
        Trainer(_cfg(root, target, "rank-bad", init_draft=str(start), grow_markov_rank=4))


def test_held_out_evaluation_is_logged_and_agrees_with_a_direct_computation(setup, tmp_path):
    """eval.jsonl: per-position mean of 1 - TV/2 on the held-out blocks at step 0, every
    eval_every steps and at the end; the step-0 record equals the same quantity computed
    directly from the untrained drafter; a drafter far from the target scores lower."""
    from sglang_dspark.drafter.training.loss import tv_ce

    root, target = setup
    held = tmp_path / "held.jsonl"
    lines = (root / "data.jsonl").read_text().splitlines()
    held.write_text("\n".join(lines[:6]) + "\n")
    cfg = _cfg(root, target, "evaluated", eval_data=str(held), eval_every=4, steps=8,
               lr=5e-3)  # fmt: skip
    trainer = Trainer(cfg)
    # direct: every fixed held-out block through the untrained drafter
    acc, cnt = torch.zeros(4), torch.zeros(4)
    for item in trainer.eval_plan:
        mb = trainer._micro_batch([item], exact=True)
        with torch.no_grad():
            logits = trainer.drafter.draft_logits(_blocks(trainer.drafter, mb), mb.prev_tokens)
            tv, _ = tv_ce(logits, trainer.target.logits(mb.target), mb.labels)
        acc += ((1 - tv / 2) * mb.valid).sum(0)
        cnt += mb.valid.float().sum(0)
    trainer.train()
    recs = [json.loads(x) for x in (root / "evaluated" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 4, 8]
    torch.testing.assert_close(torch.tensor(recs[0]["accept"]), acc / cnt, atol=1e-4, rtol=0)
    assert recs[0]["positions"] == [int(c) for c in cnt]
    a = torch.tensor(recs[0]["accept"])
    assert recs[0]["tau_estimate"] == pytest.approx(1 + float(a.cumprod(0).sum()), abs=1e-4)
    with torch.no_grad():  # a drafter far from the target scores lower
        w2 = trainer.drafter.markov_head.markov_w2.weight
        w2.copy_(torch.randn(w2.shape, generator=torch.Generator().manual_seed(0)) * 5)
    worse = trainer.evaluate()
    assert worse["step"] == 8 and sum(worse["accept"]) < sum(recs[-1]["accept"]) - 0.4
    # an interrupted run drops the lost records on resume and writes each step once
    cfg2 = dataclasses.replace(cfg, out_dir=str(root / "evaluated2"), stop_after=5)
    Trainer(cfg2).train()
    Trainer(dataclasses.replace(cfg2, stop_after=None)).train()
    recs2 = [json.loads(x) for x in (root / "evaluated2" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs2] == [0, 4, 8]
    assert recs2[-1]["accept"] == recs[-1]["accept"]
