"""Paired drafter comparison (`sglang-dspark compare`) and the evaluator's MTP-1 proposer."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_evaluate import GAMMA, add_tokenizer, build_target

from sglang_dspark import evaluation as ev
from sglang_dspark.drafter.formats.checkpoint import init_random_draft, init_random_mtp_draft
from sglang_dspark.evaluation import compare

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- MTP-1 proposer
@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-eval")
    target = build_target(root / "target", vocab=64, lm_scale=8.0)
    draft = init_random_mtp_draft(target, root / "mtp", seed=0, dtype=torch.float32)
    return ev.load_models(target, draft)


def test_mtp_greedy_speculative_output_equals_target_greedy(mtp_pair):
    target, proposer = mtp_pair
    assert isinstance(proposer, ev.MtpProposer) and proposer.gamma == 1
    for prompt in ([1, 3, 5, 2, 4], [6, 6, 1]):
        ref = ev.target_generate(
            target, prompt, max_new_tokens=30, temperature=0.0, generator=torch.Generator()
        ).tokens
        gen = ev.speculative_generate(
            target, proposer, prompt, max_new_tokens=30, temperature=0.0,
            generator=torch.Generator(),
        )  # fmt: skip
        assert gen.tokens == ref
        assert all(r.accepted in (0, 1) for r in gen.rounds)


def test_mtp_context_is_the_trainers_final_hidden_state(mtp_pair):
    """The evaluator's incremental context equals what the MTP trainer feeds the layer
    (the target's final normed hidden state), and the draft for the anchor is the layer's
    output on the row (h_{a-1}, x_a), as in training."""
    target, proposer = mtp_pair
    seq = torch.tensor([1, 3, 5, 2, 4, 7, 7, 0])
    target.reset()
    _, ctx_a = target.forward(seq[:5].tolist())
    _, ctx_b = target.forward(seq[5:].tolist())
    full = target.adapter.features(seq).final_hidden
    torch.testing.assert_close(torch.cat([ctx_a, ctx_b]), full, atol=1e-5, rtol=1e-5)
    a = seq.numel() - 1
    prop = proposer.propose(seq, full[:a], 0.0, torch.Generator())
    d = proposer.drafter
    want = d.logits(d(full[:a], seq[1:], torch.arange(a))[-1:]).float()
    torch.testing.assert_close(prop.logits, want)
    assert int(prop.tokens[0]) == int(want.argmax())


# ---------------------------------------------------------------------------- paired maths
def test_paired_ratio_of_an_arm_with_itself_is_exactly_one():
    acc, rnd = np.array([3, 10, 0, 7]), np.array([5, 6, 4, 8])
    q = compare.paired_ratio((acc, rnd), (acc, rnd))
    assert q == {"ratio": 1.0, "low": 1.0, "high": 1.0}


def test_paired_ratio_tells_a_consistent_gain_from_noise():
    rng = np.random.default_rng(1)
    rnd = rng.integers(20, 40, size=30)
    acc_a = rng.binomial(rnd * 3, 0.3)
    better = compare.paired_ratio((acc_a, rnd), (acc_a + rnd // 2, rnd))  # +0.5 token a round
    assert better["low"] > 1.0 and better["ratio"] > 1.0
    noisy = compare.paired_ratio((acc_a, rnd), (rng.permutation(acc_a), rnd))
    assert noisy["low"] < 1.0 < noisy["high"]
    tau_a = (acc_a.sum() + rnd.sum()) / rnd.sum()
    tau_b = (acc_a.sum() + (rnd // 2).sum() + rnd.sum()) / rnd.sum()
    assert better["ratio"] == pytest.approx(tau_b / tau_a)
    with pytest.raises(ValueError, match="unpaired"):
        compare.paired_ratio((acc_a, rnd), (acc_a[:-1], rnd[:-1]))


def test_parse_arm():
    assert compare.parse_arm("new=/x/y") == compare.Arm("new", Path("/x/y"))
    assert compare.parse_arm("/x/shipped").name == "shipped"
    with pytest.raises(ValueError, match="NAME=DIR"):
        compare.parse_arm("=/x")


# ---------------------------------------------------------------------------- the command
def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    argv = []
    for k, v in kw.items():
        for item in v if isinstance(v, list) else [v]:
            argv += [f"--{k.replace('_', '-')}", str(item)]
    return parser.parse_args(argv + ["--no-progress"])


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    target = build_target(root / "target", vocab=8, lm_scale=8.0)
    add_tokenizer(target)
    a = init_random_draft(target, root / "a", block_size=GAMMA, markov_rank=8,
                          num_context_features=2, seed=0)  # fmt: skip
    mtp = init_random_mtp_draft(target, root / "mtp", seed=0, dtype=torch.float32)
    eval_dir = root / "eval"
    eval_dir.mkdir()
    for name, text in {"gsm8k": "2 2 2", "mt-bench": "user 2"}.items():
        lines = [json.dumps({"turns": [f"{text} {'2 ' * i}"]}) for i in range(3)]
        (eval_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root, target, a, mtp, eval_dir


def test_compare_writes_one_paired_table(cli, capsys):
    root, target, a, mtp, eval_dir = cli
    out = root / "out"
    args = _args(target=target, draft=[f"dspark={a}", f"same={a}", f"mtp1={mtp}"], out=out,
                 eval_dir=eval_dir, benchmarks="gsm8k,mt-bench", limit=3, max_new_tokens=10,
                 temperatures="1,0")  # fmt: skip
    assert compare.run(args) == 0
    summary = json.loads((out / "comparison.json").read_text())
    rows = summary["rows"]
    assert [(r["temperature"], r["benchmark"]) for r in rows] == [
        (1.0, "gsm8k"), (1.0, "mt-bench"), (1.0, "all"),
        (0.0, "gsm8k"), (0.0, "mt-bench"), (0.0, "all"),
    ]  # fmt: skip
    for r in rows:
        assert r["prompts"] == (6 if r["benchmark"] == "all" else 3)
        # the same drafter on the same prompts and seeds: the same rounds, ratio exactly 1
        assert r["tau"]["same"] == r["tau"]["dspark"]
        assert r["ratio"]["same"] == {"ratio": 1.0, "low": 1.0, "high": 1.0}
        assert 1.0 <= r["tau"]["mtp1"] <= 2.0 and 1.0 <= r["tau"]["dspark"] <= GAMMA + 1
    per_arm = json.loads((out / "mtp1" / "results.json").read_text())
    assert per_arm["gamma"] == 1 and per_arm["results"]["1"]["overall"]["prompts"] == 6
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| T | benchmark | prompts | tau dspark | tau same | tau mtp1 |" in printed
    assert (out / "comparison.md").read_text().strip() in printed


def test_compare_reuses_a_finished_drafter_only_under_the_same_key(cli, monkeypatch):
    """A rerun reuses each drafter's saved rounds (the same table, no evaluation); changing
    the settings or the draft's files evaluates that drafter again."""
    from sglang_dspark.evaluation import runner

    root, target, a, _mtp, eval_dir = cli
    out = root / "out-reuse"
    kw = {"target": target, "out": out, "eval_dir": eval_dir, "benchmarks": "gsm8k", "limit": 2,
              "max_new_tokens": 6, "temperatures": "1"}  # fmt: skip
    draft_b = root / "b"
    shutil.copytree(a, draft_b)
    assert compare.run(_args(draft=[f"a={a}", f"b={draft_b}"], **kw)) == 0
    first = json.loads((out / "comparison.json").read_text())["rows"]
    calls = []
    original = runner.evaluate
    monkeypatch.setattr(runner, "evaluate", lambda *x, **y: calls.append(1) or original(*x, **y))
    assert compare.run(_args(draft=[f"a={a}", f"b={draft_b}"], **kw)) == 0
    assert calls == [] and json.loads((out / "comparison.json").read_text())["rows"] == first
    (draft_b / "config.json").write_text((draft_b / "config.json").read_text() + "\n")
    assert compare.run(_args(draft=[f"a={a}", f"b={draft_b}"], **kw)) == 0
    assert calls == [1]  # only b, whose files changed
    assert compare.run(_args(draft=[f"a={a}", f"b={draft_b}"], **{**kw, "max_new_tokens": 5})) == 0
    assert calls == [1, 1, 1]


def test_compare_errors_say_what_is_wrong(cli, tmp_path):
    _, target, a, _, eval_dir = cli
    with pytest.raises(ValueError, match="names must differ"):
        compare.run(_args(target=target, draft=[f"x={a}", f"x={a}"], out=tmp_path,
                          eval_dir=eval_dir, benchmarks="gsm8k"))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no config.json"):
        compare.run(_args(target=target, draft=[f"x={tmp_path}"], out=tmp_path,
                          eval_dir=eval_dir, benchmarks="gsm8k"))  # fmt: skip
