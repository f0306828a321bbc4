"""`cpu_half_gemm_fp32`: bf16 linears computed in float32 (sglang_dspark.plugin.cpu_gemm).

No server: the hook's functions against SGLang's own `UnquantizedLinearMethod.apply` and
`LogitsProcessor._compute_lm_head`, unmodified (called as `original`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_dspark.plugin import cpu_gemm


@pytest.fixture
def mode(monkeypatch):
    """Set the hook's environment for one test (settings are read once per process)."""

    def set_mode(value: str | None = None, min_rows: str | None = None):
        for env, v in ((cpu_gemm.MODE_ENV, value), (cpu_gemm.MIN_ROWS_ENV, min_rows)):
            if v is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, v)
        cpu_gemm.settings.cache_clear()

    yield set_mode
    monkeypatch.delenv(cpu_gemm.MODE_ENV, raising=False)
    monkeypatch.delenv(cpu_gemm.MIN_ROWS_ENV, raising=False)
    cpu_gemm.settings.cache_clear()


def _weights(n=320, k=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g).bfloat16()
    return x, w


def test_float32_path_is_the_bf16_values_multiplied_in_float32_and_rounded(mode):
    mode("float32", "1")
    x, w = _weights()
    bias = torch.randn(w.shape[0]).bfloat16()
    got = cpu_gemm.linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (40, w.shape[0])
    assert torch.equal(got, F.linear(x.float(), w.float(), bias.float()).bfloat16())
    # against the bf16 GEMM: the same products, summed in another order, then rounded
    native = F.linear(x, w, bias)
    assert torch.allclose(got.float(), native.float(), rtol=1.6e-2, atol=1e-2)
    assert (got != native).float().mean() < 0.05


def test_a_rows_result_does_not_depend_on_its_batch(mode):
    """Rows are padded to MKL's group of 4: row i of a batch of m equals row i of a batch of 40
    for every m (without padding the remainder rows are summed in another order)."""
    mode("float32", "1")
    x, w = _weights(n=1536)
    full = cpu_gemm.linear(x, w)
    for m in range(1, 40):
        assert torch.equal(cpu_gemm.linear(x[:m], w), full[:m]), m
    unpadded = [
        m
        for m in range(1, 40)
        if not torch.equal(F.linear(x[:m].float(), w.float()), F.linear(x.float(), w.float())[:m])
    ]
    assert unpadded, "MKL's float32 GEMM is row-invariant here: the padding is not needed"


def test_fewer_rows_than_the_minimum_keep_the_native_call(mode):
    mode("float32", "6")
    x, w = _weights()
    for m in (1, 5):
        assert torch.equal(cpu_gemm.linear(x[:m], w), F.linear(x[:m], w))
    assert torch.equal(cpu_gemm.linear(x[:6], w), F.linear(x[:6].float(), w.float()).bfloat16())
    # a 3-D input counts its rows over the leading dimensions
    x3 = x[:12].view(2, 6, -1)
    assert torch.equal(cpu_gemm.linear(x3, w), cpu_gemm.linear(x[:12], w).view(2, 6, -1))


def test_native_mode_float32_inputs_and_gradients_are_left_alone(mode):
    x, w = _weights()
    mode("native", "1")
    assert not cpu_gemm.applies(x, w)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    mode("float32", "1")
    assert not cpu_gemm.applies(x.float(), w.float())
    assert not cpu_gemm.applies(x, w.float())
    assert not cpu_gemm.applies(x, w.clone().requires_grad_())


def test_auto_follows_onednn_half_support(mode):
    mode(None, None)
    x, w = _weights()
    assert cpu_gemm.applies(x, w) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_gemm.applies(x.half(), w.half()) == (
        not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )


def test_the_float32_copy_follows_in_place_weight_updates(mode):
    mode("float32", "1")
    x, w = _weights()
    before = cpu_gemm.linear(x, w)
    assert cpu_gemm.fp32_copy(w) is cpu_gemm.fp32_copy(w)  # kept, not remade per call
    w.mul_(2)  # e.g. update_weights_from_disk copies into the same tensor
    after = cpu_gemm.linear(x, w)
    assert torch.equal(after, F.linear(x.float(), w.float()).bfloat16())
    assert not torch.equal(after, before)


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        (cpu_gemm.MODE_ENV, "fast", "is not one of auto, float32, native"),
        (cpu_gemm.MIN_ROWS_ENV, "0", "is not a whole number >= 1"),
        (cpu_gemm.MIN_ROWS_ENV, "six", "is not a whole number >= 1"),
    ],
)
def test_bad_settings_say_what_to_set(mode, monkeypatch, env, value, message):
    mode(None, None)
    monkeypatch.setenv(env, value)
    cpu_gemm.settings.cache_clear()
    with pytest.raises(ValueError, match=message):
        cpu_gemm.install()


class _Layer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def test_sglang_linear_apply_hooked(mode):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    mode("float32", "6")
    x, w = _weights()
    layer, method = _Layer(w), UnquantizedLinearMethod()
    original = UnquantizedLinearMethod.apply
    got = cpu_gemm._linear_apply(original, method, layer, x)
    assert torch.equal(got, F.linear(x.float(), w.float()).bfloat16())
    assert torch.equal(cpu_gemm._linear_apply(original, method, layer, x[:2]),
                       original(method, layer, x[:2]))  # fmt: skip
    layer.use_intel_amx_backend = True  # SGLang's AMX kernel keeps its call
    calls = []
    cpu_gemm._linear_apply(lambda *a, **k: calls.append(a), method, layer, x)
    assert len(calls) == 1


def test_sglang_lm_head_hooked_only_on_its_plain_branch(mode):
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    mode("float32", "6")
    x, w = _weights(n=2048)
    head = _Layer(w)
    head.quant_method = UnquantizedEmbeddingMethod()
    proc = LogitsProcessor.__new__(LogitsProcessor)
    proc.use_fp32_lm_head, proc.use_fp32_lm_head_output, proc.rl_on_policy_target = (
        False,
        False,
        None,
    )
    original = LogitsProcessor._compute_lm_head
    upstream = original(proc, x, head)
    got = cpu_gemm._compute_lm_head(original, proc, x, head)
    assert torch.equal(got, F.linear(x.float(), w.float()).bfloat16())
    assert torch.allclose(got.float(), upstream.float(), rtol=1.6e-2, atol=1e-2)
    proc.use_fp32_lm_head = True  # SGLang's own float32 LM head: its branch, its output
    assert torch.equal(cpu_gemm._compute_lm_head(original, proc, x, head), original(proc, x, head))
