"""`cpu_sampled_markov_step`: the CPU Markov sampling step without SGLang's torch Philox.

The hook's rows at a temperature above 0 must draw from the same categorical as upstream's
Gumbel argmax (softmax of the kept step logits over the temperature), greedy rows and the kept
step logits must be upstream's, and the stream must be a function of (key, offset, step)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from sglang.kernels.ops.speculative.dspark.markov_sample import MarkovSampleStep

from sglang_dspark.plugin import cpu_markov

VOCAB = 12


def _upstream(cls, **kwargs):
    return MarkovSampleStep.torch(**kwargs)


def _step(hooked: bool, base, bias, temperatures, *, offset=0, step=0, key=7):
    kept = torch.empty(base.shape, dtype=torch.bfloat16)
    kwargs = {
        "base_logits": base, "bias": bias, "temperatures": temperatures, "key": key,
        "offset": torch.tensor([offset]), "step": step, "step_dtype": torch.bfloat16,
        "logits_out": kept, "has_sampled_rows": None,
    }  # fmt: skip
    if hooked:
        return cpu_markov._sampled_rows(_upstream, MarkovSampleStep, **kwargs), kept
    return MarkovSampleStep.torch(**kwargs), kept


@pytest.fixture(scope="module")
def logits():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, VOCAB, generator=gen) * 2, torch.randn(3, VOCAB, generator=gen)


def test_greedy_rows_and_kept_logits_are_upstream(logits):
    base, bias = logits
    temps = torch.tensor([0.0, 1.0, 0.0])
    for offset in range(20):
        got, kept = _step(True, base, bias, temps, offset=offset)
        want, want_kept = _step(False, base, bias, temps, offset=offset)
        assert torch.equal(kept, want_kept)
        assert got[0] == want[0] and got[2] == want[2]  # greedy rows: the argmax


def test_sampled_rows_follow_the_step_distribution(logits):
    """4000 draws per row at temperatures 1 and 0.5 (one per block offset): chi-square
    against softmax(kept logits / t) passes for the hook, as for upstream's Philox; and fails
    against the wrong temperature (the test can fail)."""
    base, bias = logits
    temps = torch.tensor([1.0, 0.5, 1.0])
    n = 4000
    for hooked in (True, False):
        draws = torch.stack([_step(hooked, base, bias, temps, offset=i)[0] for i in range(n)])
        kept = _step(hooked, base, bias, temps)[1].float()
        for row, t in enumerate(temps.tolist()):
            counts = torch.bincount(draws[:, row], minlength=VOCAB).double()
            expected = torch.softmax(kept[row].double() / t, -1) * n
            assert chisquare(counts, expected).pvalue > 1e-4, (hooked, row)
            wrong = torch.softmax(kept[row].double() / (2 * t), -1) * n
            assert chisquare(counts, wrong).pvalue < 1e-6, (hooked, row)


def test_stream_is_a_function_of_key_offset_and_step(logits):
    base, bias = logits
    temps = torch.ones(3)
    runs = {(o, s): [_step(True, base, bias, temps, offset=o, step=s)[0] for _ in range(2)]
            for o in range(30) for s in range(2)}  # fmt: skip
    assert all(torch.equal(a, b) for a, b in runs.values())
    firsts = torch.stack([a for a, _ in runs.values()])
    assert len({tuple(r) for r in firsts.tolist()}) > 20  # different coordinates, new draws


def test_cuda_or_sharded_calls_are_left_to_upstream(logits):
    base, bias = logits
    calls = []

    def record(cls, **kwargs):
        calls.append(kwargs)
        return torch.zeros(3, dtype=torch.int64)

    kwargs = {
        "base_logits": base, "bias": bias, "temperatures": torch.ones(3), "key": 1,
        "offset": torch.tensor([0]), "step": 0, "step_dtype": torch.float32,
        "logits_out": torch.empty(3, VOCAB), "has_sampled_rows": None,
    }  # fmt: skip
    cpu_markov._sampled_rows(record, MarkovSampleStep, **kwargs, gather=lambda x: x)
    cpu_markov._sampled_rows(record, MarkovSampleStep, **{**kwargs, "logits_out": None})
    assert [c["has_sampled_rows"] for c in calls] == [None, None]
