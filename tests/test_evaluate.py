"""Offline evaluator: lossless decoding, acceptance bookkeeping, threshold sweep, outputs."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from sglang_dspark import evaluation as ev
from sglang_dspark.drafter.config import DSparkDraftConfig
from sglang_dspark.drafter.formats.checkpoint import DraftCheckpointError, init_random_draft
from sglang_dspark.drafter.model import DSparkDrafter, init_weights
from sglang_dspark.drafter.training.target import (
    TargetAdapter,
    load_target_config,
    make_tiny_target,
)

torch.set_num_threads(1)

GAMMA = 4
PROMPTS = [[1, 3, 5, 2, 4], [6, 6, 1], [2, 7, 3, 3, 0, 5, 1, 4]]


def build_target(out: Path, vocab: int, lm_scale: float) -> Path:
    """A tiny random Qwen3 whose LM head is scaled so its next-token distributions are far
    from uniform (a plain random init is nearly uniform: every drafter would look perfect)."""
    make_tiny_target(out, arch="qwen3", vocab_size=vocab, hidden_size=32, num_layers=3)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_scale)
    model.save_pretrained(out)
    return out


def build_pair(target_dir: Path, seed: int = 0) -> tuple[ev.CachedTarget, ev.DraftProposer]:
    cfg = DSparkDraftConfig.for_target(
        load_target_config(target_dir),
        num_layers=1,
        block_size=GAMMA,
        markov_rank=8,
        num_context_features=2,
        intermediate_size=64,
    )
    adapter = TargetAdapter.from_pretrained(target_dir, cfg.target_layer_ids)
    drafter = DSparkDrafter(cfg)
    init_weights(drafter, seed=seed, std=0.2)
    drafter.attach_shared(adapter.embed_weight, adapter.lm_head_weight)
    return ev.CachedTarget(adapter), ev.DraftProposer(drafter)


@pytest.fixture(scope="module")
def v64(tmp_path_factory) -> tuple[ev.CachedTarget, ev.DraftProposer]:
    return build_pair(build_target(tmp_path_factory.mktemp("v64"), vocab=64, lm_scale=8.0))


@pytest.fixture(scope="module")
def v8_dir(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("v8"), vocab=8, lm_scale=8.0)


class GreedyOracle:
    """Proposes the target's own greedy continuation (recomputed without a cache); with
    ``corrupt`` > 0 it replaces one random draft by a wrong token that often."""

    def __init__(self, target: ev.CachedTarget, gamma: int = GAMMA, corrupt: float = 0.0):
        self.model = target.adapter.model
        self.vocab = target.adapter.vocab_size
        self.gamma = gamma
        self.corrupt = corrupt

    @torch.inference_mode()
    def propose(self, tokens, context, temperature, generator) -> ev.Proposal:
        seq = tokens.clone()
        drafts = []
        for _ in range(self.gamma):
            nxt = self.model(input_ids=seq[None]).logits[0, -1].argmax()
            drafts.append(int(nxt))
            seq = torch.cat([seq, nxt[None]])
        if self.corrupt and float(torch.rand((), generator=generator)) < self.corrupt:
            k = int(torch.randint(self.gamma, (), generator=generator))
            drafts[k] = (drafts[k] + 1) % self.vocab
        d = torch.tensor(drafts)
        return ev.Proposal(d, torch.nn.functional.one_hot(d, self.vocab).float() * 30, None)


def accept_all(drafts, target_logits, draft_logits, temperature, generator):
    """A broken verifier: keeps every draft, then samples the bonus from the target."""
    g = drafts.numel()
    return g, ev.sample(target_logits[g], temperature, generator)


def greedy(target, prompt, n=40):
    return ev.target_generate(
        target, prompt, max_new_tokens=n, temperature=0.0, generator=torch.Generator()
    ).tokens


def spec(target, proposer, prompt, *, n=40, temperature=0.0, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return ev.speculative_generate(
        target, proposer, prompt, max_new_tokens=n, temperature=temperature, generator=gen, **kw
    )


# ---------------------------------------------------------------------------- (1), (2)
def test_greedy_speculative_output_equals_target_greedy(v64):
    target, proposer = v64
    noisy = GreedyOracle(target, corrupt=0.7)
    lengths = set()
    for prompt in PROMPTS:
        ref = greedy(target, prompt)
        assert len(ref) == 40
        assert spec(target, proposer, prompt).tokens == ref  # random drafter: mostly rejects
        out = spec(target, noisy, prompt)  # partial blocks: exercises the cache crop
        assert out.tokens == ref
        lengths.update(r.accepted for r in out.rounds)
    assert len(lengths) >= 3  # several accept lengths, not just all-or-nothing


def test_oracle_drafter_accepts_every_block(v64):
    target, _ = v64
    for prompt in PROMPTS:
        out = spec(target, GreedyOracle(target), prompt, n=41)
        assert [r.accepted for r in out.rounds] == [GAMMA] * 8  # 1 + 8 * (gamma + 1) = 41
        assert out.tokens == greedy(target, prompt, n=41)


def test_drafter_context_is_target_features_strictly_before_anchor(v64):
    target, proposer = v64
    seen = []

    class Recording:
        gamma = proposer.gamma

        def propose(self, tokens, context, temperature, generator):
            seen.append((tokens.clone(), context.clone()))
            return proposer.propose(tokens, context, temperature, generator)

    spec(target, Recording(), PROMPTS[2], n=30, temperature=1.0, seed=3)
    assert len(seen) > 3
    for tokens, context in seen:
        full = target.adapter.features(tokens[:-1]).context  # no cache, no anchor
        assert context.shape == full.shape
        torch.testing.assert_close(context, full, atol=1e-4, rtol=1e-4)


def test_proposer_block_matches_the_training_layout(v64):
    """The serving-time block equals what training computes for an anchor at the same
    position (single_sequence_layout: context rows strictly before the anchor)."""
    from sglang_dspark.drafter.model import single_sequence_layout

    target, proposer = v64
    d = proposer.drafter
    tokens = torch.tensor(PROMPTS[2])
    a = tokens.numel() - 1
    prop = proposer.propose(
        tokens, target.adapter.features(tokens[:-1]).context, 0.0, torch.Generator()
    )
    layout = single_sequence_layout(
        tokens, torch.tensor([a]), block_size=GAMMA, mask_token_id=d.config.mask_token_id
    )
    with torch.inference_mode():
        hidden = d(target.adapter.features(tokens).context, layout)  # anchor row is masked
        prev = torch.cat([tokens[-1:], prop.tokens[:-1]])[None]
        ref_logits = d.draft_logits(hidden, prev)[0]
        ref_conf = d.confidence_logits(hidden, prev)[0]
    torch.testing.assert_close(prop.logits, ref_logits.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prop.confidence_logits, ref_conf.float(), atol=1e-4, rtol=1e-4)
    assert prop.tokens.tolist() == ref_logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------- (3)
def exact_marginals(target: ev.CachedTarget, prompt: list[int], steps: int) -> list[np.ndarray]:
    """P(generated token j = v) for j = 1..steps under the target at temperature 1."""
    model = target.adapter.model
    V = target.adapter.vocab_size
    out = []
    prefixes = torch.tensor([prompt])
    weight = torch.ones(1, dtype=torch.float64)
    with torch.inference_mode():
        for _ in range(steps):
            p = torch.softmax(model(input_ids=prefixes).logits[:, -1].double(), -1)
            joint = weight[:, None] * p  # [prefixes, V]
            out.append(joint.sum(0).numpy())
            prefixes = torch.cat(
                [prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes))[:, None]],
                dim=1,
            )
            weight = joint.reshape(-1)
    return out


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled into one."""
    counts = np.bincount(samples, minlength=probs.size).astype(float)
    expected = probs / probs.sum() * samples.size
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(counts, expected).pvalue)


def test_temperature_one_matches_target_distribution(v8_dir):
    """Generated tokens 2 and 3 go through rejection sampling (token 1 is the prefill's).
    Their marginals must match the target's exact ones: chi-square at alpha = 1e-3 per token,
    so a correct sampler fails this test with probability <= 2e-3 (seeds are fixed, so the
    outcome is deterministic). The same test with rejection disabled must fail."""
    target, proposer = build_pair(v8_dir)
    prompt = PROMPTS[0]
    probs = exact_marginals(target, prompt, 3)[1:]

    def draw(n: int, **kw) -> tuple[np.ndarray, list[int]]:
        toks, acc = [], []
        for seed in range(n):
            out = spec(target, proposer, prompt, n=3, temperature=1.0, seed=seed, **kw)
            toks.append(out.tokens[1:3])
            acc += [r.accepted for r in out.rounds]
        return np.array(toks), acc

    toks, acc = draw(700)
    assert 0.1 < np.mean(acc) / GAMMA < 0.9  # both accept and reject paths are exercised
    for j in range(2):
        assert chi2_pvalue(toks[:, j], probs[j]) > 1e-3

    bad, _ = draw(200, verify=accept_all)
    assert min(chi2_pvalue(bad[:, j], probs[j]) for j in range(2)) < 1e-3


# ---------------------------------------------------------------------------- (4), (5)
@pytest.fixture(scope="module")
def run_results(v64):
    target, proposer = v64
    prompts = {"gsm8k": PROMPTS[:2], "mt-bench": PROMPTS[2:]}
    records = ev.evaluate(
        target, proposer, prompts, temperatures=[0.0, 1.0], max_new_tokens=24, progress=False
    )
    return records, ev.build_results(records, GAMMA, ev.DEFAULT_THRESHOLDS)


def test_tau_equals_one_plus_sum_of_reach_probabilities(run_results):
    records, results = run_results
    for at_t in results["results"].values():
        for m in [*at_t["benchmarks"].values(), at_t["overall"]]:
            cond = np.array(m["position_acceptance"], dtype=float)
            reach = np.cumprod(np.nan_to_num(cond))
            np.testing.assert_allclose(m["reach_probability"], reach, atol=1e-12)
            assert m["tau"] == pytest.approx(1 + reach.sum())
            assert m["acceptance_rate"] == pytest.approx((m["tau"] - 1) / GAMMA)
    rec = records[0]
    assert results["results"]["0"]["benchmarks"]["gsm8k"]["tau"] == pytest.approx(
        1 + np.mean(rec.accepted)
    )


def test_acceptance_metrics_by_hand():
    m = ev.acceptance_metrics(np.array([0, 1, 3, 3]), gamma=3)
    assert m["tau"] == pytest.approx(1 + 7 / 4)
    assert m["position_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert m["accept_length_histogram"] == [1, 1, 0, 2]


def test_sweep_at_threshold_zero_is_the_unconstrained_run(run_results):
    _, results = run_results
    for at_t in results["results"].values():
        for m in at_t["benchmarks"].values():
            s0 = m["sweep"][0]
            assert s0["threshold"] == 0.0
            assert s0["verified_drafts"] == GAMMA
            assert s0["acceptance_rate"] == pytest.approx(m["acceptance_rate"])
            assert s0["tau"] == pytest.approx(m["tau"])


def test_verified_lengths_cut_at_first_low_survival():
    c = np.array([[0.9, 0.9, 0.5, 1.0], [0.4, 1.0, 1.0, 1.0]])  # a = .9 .81 .405 .405 / .4 ..
    assert ev.verified_lengths(c, 0.5).tolist() == [2, 0]  # the anchor alone is verified
    assert ev.verified_lengths(c, 0.4).tolist() == [4, 4]
    s = ev.threshold_sweep(np.array([3, 0]), c, [0.5])[0]
    assert s["acceptance_rate"] == 1.0 and s["tau"] == pytest.approx((3 + 1) / 2)
    assert s["tau_per_verified"] == pytest.approx(4 / 4)


def test_sweep_acceptance_rises_with_calibrated_confidence():
    """With c_k = P(accept k | 1..k-1 accepted) exactly, the verified drafts at threshold t
    are those with a_k >= t and each is accepted with probability a_k, so the acceptance rate
    (a mean of a_k over a_k >= t) cannot decrease in t. The rounds below realise every
    confidence pattern with EXACT outcome frequencies, so the check has no sampling noise."""
    levels = [0.25, 0.5, 0.75, 1.0]
    gamma, reps = 3, 4**3
    accepted, conf = [], []
    for pattern in itertools.product(levels, repeat=gamma):
        a = np.cumprod(pattern)
        p_n = np.append(-np.diff(np.concatenate([[1.0], a])), a[-1])  # P(n = 0..gamma)
        counts = np.rint(p_n * reps).astype(int)
        assert counts.sum() == reps and np.allclose(counts, p_n * reps)
        for n, c in enumerate(counts):
            accepted += [n] * c
            conf += [pattern] * c
    sweep = ev.threshold_sweep(np.array(accepted), np.array(conf), np.linspace(0, 1, 21))
    rates = [s["acceptance_rate"] for s in sweep]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(rates))
    assert rates[0] == pytest.approx(np.mean(accepted) / gamma)
    assert rates[-1] == 1.0  # only certain drafts remain


# ---------------------------------------------------------------------------- (6) CLI
def add_tokenizer(target_dir: Path) -> None:
    """A word-level tokenizer for the 8-token vocabulary, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "assistant", ":", "2"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    fast.save_pretrained(target_dir)


def cli_args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ev.add_arguments(parser)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv + ["--no-progress"])


@pytest.fixture(scope="module")
def cli_setup(v8_dir, tmp_path_factory):
    add_tokenizer(v8_dir)
    root = tmp_path_factory.mktemp("cli")
    draft = init_random_draft(
        v8_dir, root / "draft", block_size=GAMMA, markov_rank=8, num_context_features=2
    )
    eval_dir = root / "eval"
    eval_dir.mkdir()
    for name, text in {"gsm8k": "what is 2 + 2 ?", "mt-bench": "tell me a story"}.items():
        lines = [json.dumps({"turns": [f"{text} {i}", "second turn"]}) for i in range(3)]
        (eval_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return v8_dir, draft, eval_dir, root


def test_cli_writes_results_json_calibration_and_plots(cli_setup):
    target, draft, eval_dir, root = cli_setup
    out = root / "out"
    args = cli_args(
        target=target, draft=draft, out=out, eval_dir=eval_dir, benchmarks="gsm8k,mt-bench",
        limit=2, temperatures="0,1", max_new_tokens=12,
    )  # fmt: skip
    assert ev.run(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["results"]) == {"0", "1"}
    for at_t in res["results"].values():
        assert set(at_t["benchmarks"]) == {"gsm8k", "mt-bench"}
        assert set(at_t["domains"]) == {"math", "chat"}
        o = at_t["overall"]
        assert o["prompts"] == 4 and 1.0 <= o["tau"] <= GAMMA + 1
        assert len(o["position_acceptance"]) == GAMMA and len(o["sweep"]) > 1
        assert o["tokens_per_s"] > 0
    assert res["config"]["max_new_tokens"] == 12 and res["gamma"] == GAMMA
    for name in ("position_acceptance", "threshold_sweep", "tau"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    cal = np.load(out / "calibration.npz")
    n, logits = cal["accepted"], cal["confidence_logits"]
    assert logits.shape == (n.size, GAMMA)
    assert n.size == sum(r["overall"]["rounds"] for r in res["results"].values())
    assert cal["pair_label"].size == np.minimum(n + 1, GAMMA).sum()
    assert cal["pair_label"].sum() == n.sum()


def test_cli_errors_say_what_is_wrong(cli_setup, tmp_path):
    target, draft, eval_dir, _ = cli_setup
    args = cli_args(target=target, draft=draft, out=tmp_path, eval_dir=eval_dir,
                    benchmarks="humaneval")  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"humaneval\.jsonl"):
        ev.run(args)
    other = make_tiny_target(tmp_path / "other", arch="qwen3", vocab_size=8, hidden_size=48)
    with pytest.raises(DraftCheckpointError, match="does not fit the target"):
        ev.run(cli_args(target=other, draft=draft, out=tmp_path, eval_dir=eval_dir,
                        benchmarks="gsm8k"))  # fmt: skip


def test_benchmark_prompts_ship_inside_the_package(monkeypatch):
    """A user's clone has only the repository: the default eval folder is in the package."""
    monkeypatch.delenv("DSPARK_EVAL_DIR", raising=False)
    package = Path(ev.__file__).resolve().parents[1]
    assert ev.default_eval_dir().is_relative_to(package)
    counts = {
        name: len(ev.load_prompts(ev.default_eval_dir(), name)) for name in ev.DEFAULT_BENCHMARKS
    }
    assert counts == {"gsm8k": 1319, "humaneval": 164, "mt-bench": 80}
    assert "def has_close_elements" in ev.load_prompts(ev.default_eval_dir(), "humaneval", 1)[0]


def test_no_code_reads_a_folder_outside_the_repository():
    """Tests, tools and CI run from a clone alone: nothing may read a folder beside it."""
    repo = Path(__file__).resolve().parents[1]
    sources = [
        *repo.glob("sglang_dspark/**/*.py"), *repo.glob("tests/**/*.py"), *repo.glob("scripts/*.py"),
        *repo.glob("recipes/*.py"), *repo.glob("experiments/*"), *repo.glob("benchmarks/*.py"),
        *repo.glob("loadtest/*.py"), repo / "Makefile",
        repo / ".ci" / "run",
    ]  # fmt: skip
    needle = "../" + "shared"
    offenders = [str(p.relative_to(repo)) for p in sources if needle in p.read_text()]
    assert offenders == []
