"""(d) KV norm + RoPE + fp8 pack store into V4's 584-byte FlashMLA rows.

The Triton kernel runs on CPU under Triton's interpreter (compiled on a GPU) and is compared with
the torch reference on a ragged verify batch; on a GPU also with SGLang's
`fused_k_norm_rope_flashmla`.
"""

import pytest
import torch
from dspark_kernels import kv_layout, kv_store, rotation
from kernel_interpreter import DEVICE, direct, interpreter_test, needs_gpu

test_in_triton_interpreter = interpreter_test(__file__)


PAGE = 256
# verify lengths 1 .. gamma + 1 (gamma = 5) mixed, prefixes placing blocks across page ends
VERIFY_LENS = [1, 6, 3, 5, 2, 4, 6]
PREFIX_LENS = [40, 252, 255, 509, 0, 254, 100]
# physical pages of each request: logical page p of request b is PAGES[b][p]
PAGES = [[3], [1, 4], [0, 2], [5, 6, 5], [6], [2, 3], [4]]


def freqs_cis(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    inv = theta ** (-torch.arange(0, 32, dtype=torch.float64) / 32)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def ragged_batch(dtype: torch.dtype, seed: int = 0):
    """Rows of a verify batch: kv (strided rows), positions and slots; one slot is -1."""
    gen = torch.Generator().manual_seed(seed)
    positions, slots = [], []
    for prefix, n, pages in zip(PREFIX_LENS, VERIFY_LENS, PAGES):
        for pos in range(prefix, prefix + n):
            positions.append(pos)
            slots.append(pages[pos // PAGE] * PAGE + pos % PAGE)
    slots[3] = -1  # an uncommitted row: no KV write
    n = len(positions)
    wide = (torch.randn(n, 640, generator=gen) * 3).to(dtype)
    kv = wide[:, 64:576]  # row stride 640, as the `qkv_a` slice SGLang passes
    weight = (1 + 0.3 * torch.randn(512, generator=gen)).to(dtype)
    return kv, weight, torch.tensor(positions), torch.tensor(slots, dtype=torch.int32)


def assert_v4_close(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor):
    """Same bytes but for rare last-bit flips of the fp8 / bf16 rounding (the kernel and torch sum
    the RMS in different orders); unwritten bytes untouched."""
    differ = int((got != want).sum())
    assert differ <= 0.002 * slots.numel() * kv_layout.V4_TOKEN_BYTES, f"{differ} bytes differ"
    live = slots[slots >= 0].long()
    _, g_exp, g_rope = kv_layout.read_v4_rows(got, live)
    _, w_exp, w_rope = kv_layout.read_v4_rows(want, live)
    assert torch.equal(g_exp, w_exp)
    torch.testing.assert_close(g_rope.float(), w_rope.float(), rtol=2**-7, atol=1e-6)
    g, w = kv_layout.dequantize_v4_rows(got, live), kv_layout.dequantize_v4_rows(want, live)
    step = (w.abs() / 8).clamp_min(2.0**-9 * 2.0 ** (w_exp.float().max() - 127))
    assert bool(((g - w).abs() <= step).all())


@direct
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_nope_bf16", [False, True])
def test_store_matches_reference_on_ragged_verify(dtype, round_nope_bf16):
    kv, weight, positions, slots = ragged_batch(dtype)
    freqs = freqs_cis(1024)
    got = kv_layout.new_v4_cache(7, PAGE)
    want = got.clone()
    dev = lambda t: t.to(DEVICE)
    got_dev = dev(got)
    kv_store.kv_norm_rope_store(
        dev(kv), dev(weight), 1e-6, dev(freqs), dev(positions), dev(slots), got_dev, PAGE,
        round_nope_bf16,
    )  # fmt: skip
    kv_store.kv_norm_rope_store_reference(
        kv, weight, 1e-6, freqs, positions, slots, want, PAGE, round_nope_bf16
    )
    assert_v4_close(got_dev.cpu(), want, slots)
    # the skipped row's slot stays zero
    skipped = torch.tensor([PAGES[1][0] * PAGE + PREFIX_LENS[1] + 2])
    assert not kv_layout.read_v4_rows(got_dev.cpu(), skipped)[1].any()


@direct
def test_reference_round_trips_through_the_layout():
    """The reference's rows dequantize to the normed, roped input within fp8 precision."""
    kv, weight, positions, slots = ragged_batch(torch.float32, seed=3)
    cache = kv_layout.new_v4_cache(7, PAGE)
    kv_store.kv_norm_rope_store_reference(
        kv, weight, 1e-6, freqs_cis(1024), positions, slots, cache
    )
    keep = slots >= 0
    x = kv[keep]
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    freqs = torch.view_as_real(freqs_cis(1024))[positions[keep]]
    y = rotation.rope_tail_torch(y, freqs)
    back = kv_layout.dequantize_v4_rows(cache, slots[keep].long())
    torch.testing.assert_close(back[:, 448:], y[:, 448:], rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(
        back[:, :448], y[:, :448], rtol=0.07, atol=0.07 * y.abs().max().item()
    )


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_matches_sglang_fused_k_norm_rope_flashmla(dtype):
    from sglang.kernels.ops.attention.dsv4 import fused_k_norm_rope_flashmla

    kv, weight, positions, slots = [t.cuda() for t in ragged_batch(dtype, seed=1)]
    freqs = freqs_cis(1024).cuda()
    ours = kv_layout.new_v4_cache(7, PAGE, device="cuda")
    theirs = ours.clone()
    kv_store.kv_norm_rope_store(kv, weight, 1e-6, freqs, positions, slots, ours, PAGE)
    fused_k_norm_rope_flashmla(kv, weight, 1e-6, freqs, positions, slots, theirs, PAGE)
    assert_v4_close(ours.cpu(), theirs.cpu(), slots.cpu())
