"""The batched trainer equals the per-sequence one: target features of a right-padded batch
equal each sequence's alone, and a micro-batch of many sequences with chunked vocabulary
losses gives the loss sums and gradients of one-sequence micro-batches (float32, CPU), for
the DSpark, MTP-1 and DeepSeek-V4 trainers. Resume stays bit-exact whatever the cache holds."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_dspark.drafter.training.config import TrainConfig
from sglang_dspark.drafter.training.registry import build_trainer
from sglang_dspark.drafter.training.runtime import to_device
from sglang_dspark.drafter.training.target import make_tiny_target, padded_batch

torch.set_num_threads(1)
EVAL = Path(__file__).resolve().parents[1] / "sglang_dspark" / "assets" / "eval"


def _write_data(path: Path, n: int = 12, vocab: int = 256, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length, prompt = rng.randint(14, 60), rng.randint(2, 8)  # unequal: padding
            ids = [rng.randrange(vocab) for _ in range(length)]
            f.write(
                json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
                + "\n"
            )
    return path


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    targets = {
        arch: make_tiny_target(root / arch, arch=arch, num_layers=4) for arch in ("llama", "qwen3")
    }
    return root, targets, _write_data(root / "data.jsonl")


def _cfg(target: Path, data: Path, out: Path, **kw) -> TrainConfig:
    base = {"data": str(data), "target": str(target), "out_dir": str(out), "block_size": 4, "num_layers": 1,
                "markov_rank": 16, "target_layer_ids": [0, 2], "num_anchors": 5, "global_batch_size": 4,
                "micro_batch_size": 4, "steps": 6, "checkpoint_every": 2, "lr": 2e-3, "precision": "fp32",
                "export_dtype": "float32", "progress": False, "seed": 3, "feature_cache_gb": 0.0}  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _features_match(trainer) -> None:
    seqs = [s.input_ids for s in trainer.sequences[:5]]
    assert padded_batch(seqs)[1] is not None  # unequal lengths: the batch is padded
    batched = trainer._compute_features_batch(seqs)
    for ids, got in zip(seqs, batched):
        want = trainer._compute_features(ids)  # the sequence alone, batch of one
        assert got.final_hidden.shape[0] == ids.numel()
        for name, t in want.tensors().items():
            torch.testing.assert_close(got.tensors()[name], t, rtol=1e-5, atol=1e-5)


def _step(trainer, plan, micro: int, chunk: int):
    """Loss sums and gradients of one step's plan in micro-batches of ``micro`` sequences,
    vocabulary losses in chunks of ``chunk`` LM-head rows (0: one chunk)."""
    trainer.cfg.micro_batch_size, trainer.cfg.loss_chunk_rows = micro, chunk
    w = trainer._weight_totals(plan)
    trainer.optimizer.zero_grad(set_to_none=True)
    total = None
    for i in range(0, len(plan), micro):
        mb = trainer._micro_batch(plan[i : i + micro])
        if mb is None:
            continue
        sums = trainer._forward_backward(to_device(mb, trainer.device), w[0], w[1]).as_tensor()
        total = sums if total is None else total + sums
    grads = {n: p.grad.clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None}
    return total, grads


def _batched_equals_per_sequence(trainer) -> None:
    plan = trainer._plan(0)
    ref_sums, ref_grads = _step(trainer, plan, micro=1, chunk=0)  # per sequence, whole
    sums, grads = _step(trainer, plan, micro=len(plan), chunk=3)  # one batch, tiny chunks
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 3
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dspark_batched_features_and_loss_equal_per_sequence(dense, arch, tmp_path):
    _root, targets, data = dense
    trainer = build_trainer(_cfg(targets[arch], data, tmp_path / "run"))
    _features_match(trainer)
    _batched_equals_per_sequence(trainer)


def test_dspark_dense_mse_and_top_k_terms_batch_too(dense, tmp_path):
    _root, targets, data = dense
    mse = build_trainer(
        _cfg(targets["llama"], data, tmp_path / "mse", mse_weight=0.5, dense_anchors=3)
    )
    _batched_equals_per_sequence(mse)
    topk = build_trainer(_cfg(targets["llama"], data, tmp_path / "topk", target_topk=7))
    _features_match(topk)
    _batched_equals_per_sequence(topk)


def test_mtp_batched_features_and_loss_equal_per_sequence(dense, tmp_path):
    _root, targets, data = dense
    trainer = build_trainer(_cfg(targets["llama"], data, tmp_path / "mtp", drafter="mtp"))
    _features_match(trainer)
    _batched_equals_per_sequence(trainer)


def test_v4_batched_features_and_loss_equal_per_sequence(tmp_path_factory):
    from tokenizers import Tokenizer

    from sglang_dspark.v4.tiny import build_tiny_v4

    root = tmp_path_factory.mktemp("batching-v4")
    tiny = build_tiny_v4(root / "ckpt", seed=0)
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    with open(EVAL / "gsm8k.jsonl") as f:
        texts = [json.loads(line)["turns"][0] for _, line in zip(range(6), f)]
    with open(root / "data.jsonl", "w") as f:
        for t in texts:
            ids = tok.encode(t).ids[:150]
            f.write(
                json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)}) + "\n"
            )
    cfg = _cfg(tiny, root / "data.jsonl", root / "run", drafter="dspark-v4", target_layer_ids=None,
               block_size=5, markov_rank=8, target_dtype="float32")  # fmt: skip
    trainer = build_trainer(cfg)
    _features_match(trainer)
    _batched_equals_per_sequence(trainer)


@pytest.mark.parametrize("cache_gb", [0.0, 1.5e-4, 1.0])  # none, some groups, everything
def test_resume_is_bit_exact_whatever_the_cache_holds(dense, tmp_path, cache_gb):
    """6 steps of 4 over 12 sequences (2 epochs), checkpoint every 2; an interrupted run
    resumed from step 2 ends with exactly the weights of an uninterrupted one."""
    _root, targets, data = dense
    kw = {"feature_cache_gb": cache_gb, "micro_batch_size": 2, "target_batch_size": 3}
    straight = build_trainer(_cfg(targets["llama"], data, tmp_path / "straight", **kw))
    if cache_gb == 1.5e-4:
        straight._plan_cache()
        assert 0 < len(straight._group_of) < len(straight.sequences)
    a = load_file(str(straight.train() / "model.safetensors"))
    cfg = _cfg(targets["llama"], data, tmp_path / "resumed", stop_after=3, **kw)
    build_trainer(cfg).train()
    resumed = build_trainer(dataclasses.replace(cfg, stop_after=None))
    assert resumed.step == 2
    b = load_file(str(resumed.train() / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
