"""(b) Indexer query preparation (RoPE + Hadamard + fp8) and the indexer K store.

Triton under Triton's interpreter on CPU (compiled on a GPU) against the torch reference; on a GPU
also against SGLang's `fused_q_indexer_rope_hadamard_quant`.
"""

import torch
from dspark_kernels import indexer_query, kv_layout, rotation
from kernel_interpreter import DEVICE, direct, interpreter_test, needs_gpu

test_in_triton_interpreter = interpreter_test(__file__)


HEADS = 64  # V4 index_n_heads
VERIFY_LENS = [1, 6, 2, 5, 3, 4]  # 1 .. gamma + 1 mixed
PREFIX_LENS = [7, 250, 0, 4093, 128, 61]


def freqs_cis(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    inv = theta ** (-torch.arange(0, 32, dtype=torch.float64) / 32)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def query_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor(
        [p for prefix, n in zip(PREFIX_LENS, VERIFY_LENS) for p in range(prefix, prefix + n)]
    )
    n = positions.numel()
    q = (torch.randn(n, HEADS, 128, generator=gen) * 2).to(torch.bfloat16)
    q[0, 0] = 0  # an all-zero head: scale floors at 1e-4 / 448
    weight = torch.randn(n, HEADS, generator=gen).to(torch.bfloat16)
    return q, weight, 128**-0.5 * HEADS**-0.5, positions


def assert_fp8_close(got_codes, want_codes, got_scale, want_scale):
    """Codes equal but for rare one-step flips at rounding ties; scales to float32 rounding."""
    torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
    got = got_codes.view(torch.float8_e4m3fn).float()
    want = want_codes.view(torch.float8_e4m3fn).float()
    assert float((got != want).float().mean()) < 0.002
    assert bool(((got - want).abs() <= want.abs() / 8 + 2**-9).all())


@direct
def test_query_matches_reference_on_ragged_verify():
    q, weight, scale, positions = query_batch()
    freqs = freqs_cis(4200)
    got_q, got_w = indexer_query.indexer_query(
        q.to(DEVICE), weight.to(DEVICE), scale, freqs.to(DEVICE), positions.to(DEVICE)
    )
    want_q, want_w = indexer_query.indexer_query_reference(q, weight, scale, freqs, positions)
    assert got_q.shape == (q.shape[0], HEADS, 128) and got_q.dtype == torch.float8_e4m3fn
    assert got_w.shape == (q.shape[0], HEADS, 1) and got_w.dtype == torch.float32
    q_scale = got_w.cpu() / (weight.float()[..., None] * scale)
    want_scale = want_w / (weight.float()[..., None] * scale)
    assert_fp8_close(got_q.cpu(), want_q, q_scale, want_scale)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-6, atol=1e-12)


@direct
def test_query_head_tile_does_not_change_the_bytes():
    """The serving hook runs every head in one tile under the interpreter (one Python program per
    tile); the kernel's default tile is 16 heads: both write the same codes and weights."""
    q, weight, scale, positions = query_batch(seed=1)
    args = (
        q.to(DEVICE),
        weight.to(DEVICE),
        scale,
        freqs_cis(4200).to(DEVICE),
        positions.to(DEVICE),
    )
    tiled_q, tiled_w = indexer_query.indexer_query(*args)
    whole_q, whole_w = indexer_query.indexer_query(*args, block_h=HEADS)
    assert torch.equal(whole_q.view(torch.uint8), tiled_q.view(torch.uint8))
    assert torch.equal(whole_w, tiled_w)


@direct
def test_query_reference_preserves_logits():
    """The rotation is orthonormal: q . k is kept when both sides are rotated (fp8 aside)."""
    q, weight, scale, positions = query_batch(seed=2)
    freqs = freqs_cis(4200)
    codes, weights = indexer_query.indexer_query_reference(q, weight, scale, freqs, positions)
    q_scale = (weights / (weight.float()[..., None] * scale)).clamp_min(0)
    deq = codes.float() * q_scale
    roped = rotation.rope_tail_torch(q.float(), torch.view_as_real(freqs)[positions][:, None])
    k = torch.randn(128, generator=torch.Generator().manual_seed(3))
    got, want = deq @ rotation.hadamard_torch(k), roped @ k
    assert float((got - want).norm() / want.norm()) < 0.05  # fp8 e4m3: ~3% relative rms


@direct
def test_index_k_store_matches_reference():
    """The C4 indexer compressor's store: rows of closing tokens only, slots across pages."""
    gen = torch.Generator().manual_seed(4)
    positions = torch.tensor([3, 4, 7, 255, 259, -1, 63, 127])  # -1: a padding token
    slots = torch.tensor([0, 9, 1, 63, 64, 5, 70, 127])
    k = torch.randn(positions.numel(), 128, generator=gen) * 3
    weight = 1 + 0.2 * torch.randn(128, generator=gen)
    freqs = freqs_cis(512)
    got = kv_layout.new_index_cache(2).to(DEVICE)
    want = kv_layout.new_index_cache(2)
    indexer_query.index_k_store(
        k.to(DEVICE), weight.to(DEVICE), 1e-6, freqs.to(DEVICE), positions.to(DEVICE),
        slots.to(DEVICE), got,
    )  # fmt: skip
    closing = (positions >= 0) & ((positions + 1) % 4 == 0)
    indexer_query.index_k_store_reference(
        k[closing], weight, 1e-6, freqs, positions[closing] - 3, slots[closing], want
    )
    got = got.cpu()
    live = slots[closing]
    g_codes, g_scale = kv_layout.read_index_rows(got, live)
    w_codes, w_scale = kv_layout.read_index_rows(want, live)
    assert_fp8_close(g_codes, w_codes, g_scale, w_scale)
    others = torch.tensor([9, 5])  # the non-closing and the padding token wrote nothing
    assert not kv_layout.read_index_rows(got, others)[0].any()


@needs_gpu
def test_query_matches_sglang_fused_q_indexer_rope_hadamard_quant():
    from sglang.kernels.ops.attention.dsv4 import fused_q_indexer_rope_hadamard_quant

    q, weight, scale, positions = [
        t.cuda() if isinstance(t, torch.Tensor) else t for t in query_batch(seed=1)
    ]
    freqs = freqs_cis(4200).cuda()
    got_q, got_w = indexer_query.indexer_query(q, weight, scale, freqs, positions)
    want_q, want_w = fused_q_indexer_rope_hadamard_quant(q, weight, scale, freqs, positions)
    base = weight.float()[..., None] * scale
    assert_fp8_close(
        got_q.view(torch.uint8).cpu(), want_q.view(torch.uint8).cpu(),
        (got_w / base).cpu(), (want_w / base).cpu(),
    )  # fmt: skip
