"""The bit-level number formats the kernels write (bf16, fp8 e4m3, UE8M0) against torch's casts.

On CPU the Triton helpers run in Triton's interpreter, whose own downcasts are not
round-to-nearest-even; that is why the kernels encode these formats with integer operations.
"""

import torch
import triton
import triton.language as tl
from dspark_kernels import numerics, rotation
from kernel_interpreter import DEVICE, direct, interpreter_test, needs_gpu

test_in_triton_interpreter = interpreter_test(__file__)


@triton.jit
def _encode_kernel(X, BF16, E4M3, UE8M0, VALUE, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i)
    tl.store(BF16 + i, numerics.round_bf16(x))
    code = numerics.e4m3_bits(x)
    tl.store(E4M3 + i, code)
    tl.store(VALUE + i, numerics.e4m3_value(code))
    tl.store(UE8M0 + i, numerics.ue8m0_ceil(tl.abs(x) + 1e-30).to(tl.int32))


def _interesting_floats() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties), just off them, out-of-range
    values, subnormals and random floats, both signs; 4096 in all."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 0x7F is NaN
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    nudged = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    extra = torch.tensor([448.0, 460.0, 464.0, 500.0, 1e4, 2**-10, 2**-11, 3 * 2**-11, 1e-30])
    random = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 30
    pool = torch.cat([values, mids, nudged, extra])
    pool = torch.cat([pool, -pool])
    return torch.cat([pool, random[: 4096 - pool.numel()]])


@direct
def test_formats_match_torch_casts():
    x = _interesting_floats().to(DEVICE)
    n = x.numel()
    bf16 = torch.empty(n, device=DEVICE)
    e4m3 = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    value = torch.empty(n, device=DEVICE)
    ue8m0 = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _encode_kernel[(1,)](x, bf16, e4m3, ue8m0, value, N=n)

    assert torch.equal(bf16, numerics.round_bf16_torch(x))
    assert torch.equal(e4m3, numerics.e4m3_bits_torch(x))
    assert torch.equal(value, numerics.e4m3_value_torch(e4m3))
    assert torch.equal(ue8m0, numerics.ue8m0_ceil_torch(x.abs() + 1e-30))
    # the scale is the next power of two: 2^(e - 127) >= x > 2^(e - 128)
    scale = numerics.ue8m0_value_torch(ue8m0)
    assert bool(((scale >= x.abs()) & (scale / 2 < x.abs() + 1e-30)).all())


@direct
def test_hadamard_reference_is_the_scaled_sylvester_matrix():
    rot = rotation
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ rot.sylvester_hadamard(128) / 128**0.5
    torch.testing.assert_close(rot.hadamard_torch(x), expected, rtol=1e-5, atol=1e-5)


@needs_gpu
def test_e4m3_encoding_matches_sglang_pack_fp8():
    from sglang.test.kernels.deepseek_v4.fp8_cvt import cvt_fp8_e4m3

    x = _interesting_floats().to("cuda")
    assert torch.equal(numerics.e4m3_bits_torch(x), cvt_fp8_e4m3(x.contiguous()))
