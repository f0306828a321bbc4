"""The ragged verify plan: per-token metadata of a variable-length verify batch.

A verify batch of `B` requests flattens request `b`'s `verify_lens[b]` tokens (anchor + accepted
drafts, 1 .. gamma + 1) after its `prefix_lens[b]` committed tokens, padded to `num_tokens` (the
graph bucket, `RaggedVerifyLayout.graph_num_tokens`). Token `t` of request `b` sits at
`position = prefix_lens[b] + j`; SGLang (`srt/speculative/ragged_verify.py`,
`init_forward_metadata_target_verify`) makes each token its own attention / indexer row with
`seq_len = position + 1`. Per token the plan holds:

- `token_req` `[T]` int32: the request (batch index), `-1` on padding tokens;
- `token_pos` `[T]` int32: the position, `-1` on padding tokens;
- `c4_lens` / `c128_lens` `[T]` int32: compressed history lengths `(position + 1) // ratio`;
- `c4_out_loc` / `c128_out_loc` `[T]` int64: the compressed-cache slot a token fills when
  `(position + 1) % ratio == 0` (`raw_out_loc // ratio`, else 0), as
  `_init_compressed_attn_metadata_kernel` (`kernels/ops/attention/dsv4/metadata_kernel.py`).

The compressor needs no separate plan tensors: its kernels derive SGLang's `CompressPlan`
(`seq_len, ragged_id, buffer_len, read_page_0/1`) and `WritePlan` (`ragged_id, write_loc`) per
token from this plan (see `compressor.py`). `compress_plans_reference` builds SGLang's compact
plans exactly as `plan_compress_prefill` (`kernels/jit/csrc/deepseek_v4/c_plan.cuh`, CPU path)
does, for comparison with SGLang's planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class RaggedVerifyPlan:
    verify_lens: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32, committed tokens before the verify block
    token_req: torch.Tensor  # [T] int32
    token_pos: torch.Tensor  # [T] int32
    c4_lens: torch.Tensor  # [T] int32
    c128_lens: torch.Tensor  # [T] int32
    c4_out_loc: torch.Tensor  # [T] int64
    c128_out_loc: torch.Tensor  # [T] int64

    @property
    def num_tokens(self) -> int:
        return int(self.token_req.shape[0])


@triton.jit
def _ragged_plan_kernel(
    VERIFY,
    PREFIX,
    RAW_LOC,
    TOKEN_REQ,
    TOKEN_POS,
    C4_LEN,
    C128_LEN,
    C4_LOC,
    C128_LOC,
    num_reqs,
    num_tokens,
    HAS_RAW: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program `b < num_reqs` writes request `b`'s tokens; program `num_reqs` the padding."""
    b = tl.program_id(0)
    reqs = tl.arange(0, BLOCK_B)
    lens = tl.load(VERIFY + reqs, mask=reqs < num_reqs, other=0)
    start = tl.sum(tl.where(reqs < b, lens, 0))
    if b < num_reqs:
        count = tl.load(VERIFY + b)
        prefix = tl.load(PREFIX + b)
        req = b
    else:
        count = num_tokens - start
        prefix = b * 0
        req = b * 0 - 1
    for j0 in range(0, count, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        mask = j < count
        t = start + j
        pos = tl.where(req >= 0, prefix + j, -1)
        tl.store(TOKEN_REQ + t, tl.zeros_like(j) + req, mask=mask)
        tl.store(TOKEN_POS + t, pos, mask=mask)
        tl.store(C4_LEN + t, tl.where(pos >= 0, (pos + 1) // 4, 0), mask=mask)
        tl.store(C128_LEN + t, tl.where(pos >= 0, (pos + 1) // 128, 0), mask=mask)
        if HAS_RAW:
            raw = tl.load(RAW_LOC + t, mask=mask & (pos >= 0), other=0).to(tl.int64)
            c4 = (pos >= 0) & ((pos + 1) % 4 == 0)
            c128 = (pos >= 0) & ((pos + 1) % 128 == 0)
            tl.store(C4_LOC + t, tl.where(c4, raw // 4, 0), mask=mask)
            tl.store(C128_LOC + t, tl.where(c128, raw // 128, 0), mask=mask)


def _check(verify_lens: torch.Tensor, prefix_lens: torch.Tensor, num_tokens: int) -> None:
    if verify_lens.ndim != 1 or prefix_lens.shape != verify_lens.shape:
        raise ValueError("verify_lens and prefix_lens must both be [B]")
    if verify_lens.numel() == 0:
        raise ValueError("a ragged verify plan needs at least one request")


def ragged_verify_plan(
    verify_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_tokens: int,
    raw_out_loc: torch.Tensor | None = None,
) -> RaggedVerifyPlan:
    """Triton: the plan of a verify batch, without a host sync.

    `verify_lens` / `prefix_lens` `[B]` (device), `num_tokens` >= `sum(verify_lens)` (the padded
    token count), `raw_out_loc` `[num_tokens]` the full-pool slot of each token (optional; the
    compressed out-locs are 0 without it). Every `verify_lens[b]` must be >= 1.
    """
    _check(verify_lens, prefix_lens, num_tokens)
    device = verify_lens.device
    num_reqs = verify_lens.numel()
    i32 = {"dtype": torch.int32, "device": device}
    plan = RaggedVerifyPlan(
        verify_lens=verify_lens.to(torch.int32).contiguous(),
        prefix_lens=prefix_lens.to(torch.int32).contiguous(),
        token_req=torch.empty(num_tokens, **i32),
        token_pos=torch.empty(num_tokens, **i32),
        c4_lens=torch.empty(num_tokens, **i32),
        c128_lens=torch.empty(num_tokens, **i32),
        c4_out_loc=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        c128_out_loc=torch.zeros(num_tokens, dtype=torch.int64, device=device),
    )
    if num_tokens == 0:
        return plan
    has_raw = raw_out_loc is not None
    _ragged_plan_kernel[(num_reqs + 1,)](
        plan.verify_lens,
        plan.prefix_lens,
        raw_out_loc if has_raw else plan.c4_out_loc,
        plan.token_req,
        plan.token_pos,
        plan.c4_lens,
        plan.c128_lens,
        plan.c4_out_loc,
        plan.c128_out_loc,
        num_reqs,
        num_tokens,
        HAS_RAW=has_raw,
        BLOCK_B=triton.next_power_of_2(num_reqs),
        BLOCK_T=16,
        num_warps=1,
    )
    return plan


def ragged_verify_plan_reference(
    verify_lens: list[int],
    prefix_lens: list[int],
    num_tokens: int,
    raw_out_loc: torch.Tensor | None = None,
) -> RaggedVerifyPlan:
    """Torch/Python reference of `ragged_verify_plan` from host lists."""
    if sum(verify_lens) > num_tokens or min(verify_lens) < 1:
        raise ValueError(
            f"verify_lens {verify_lens} must be >= 1 each and sum to at most {num_tokens}"
        )
    req, pos = [], []
    for b, (n, prefix) in enumerate(zip(verify_lens, prefix_lens)):
        req += [b] * n
        pos += list(range(prefix, prefix + n))
    pad = num_tokens - len(req)
    token_req = torch.tensor(req + [-1] * pad, dtype=torch.int32)
    token_pos = torch.tensor(pos + [-1] * pad, dtype=torch.int32)
    valid = token_pos >= 0
    seq = (token_pos + 1).long()
    raw = torch.zeros(num_tokens, dtype=torch.int64) if raw_out_loc is None else raw_out_loc.long()

    def out_loc(ratio):
        keep = valid & (seq % ratio == 0)
        return (
            torch.where(keep, raw // ratio, 0) if raw_out_loc is not None else torch.zeros_like(raw)
        )

    return RaggedVerifyPlan(
        verify_lens=torch.tensor(verify_lens, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        token_req=token_req,
        token_pos=token_pos,
        c4_lens=torch.where(valid, seq // 4, 0).to(torch.int32),
        c128_lens=torch.where(valid, seq // 128, 0).to(torch.int32),
        c4_out_loc=out_loc(4),
        c128_out_loc=out_loc(128),
    )


@dataclass(frozen=True)
class StateAddressing:
    """Where the compressor's per-token state lives (SGLang's `plan_compress_prefill_kernel_1`).

    Request ring (C128 always; C4 with `use_req_ring`): slot `rid * ring_size + pos % ring_size`.
    Otherwise (C4, paged by the SWA pool): `swa = full_to_swa[req_to_token[rid, pos]]`, slot
    `(swa // swa_page_size) * ring_size + swa % ring_size`.
    """

    req_pool_indices: torch.Tensor  # [B] int64
    req_to_token: torch.Tensor  # [num_reqs, max_tokens] int32
    full_to_swa: torch.Tensor  # [num_full_slots] int64
    swa_page_size: int
    ring_size: int
    use_req_ring: bool = False


def state_slot(addr: StateAddressing, ratio: int, b: int, pos: int) -> int:
    """State-pool row of request `b`'s token at `pos` (Python, for the references)."""
    rid = int(addr.req_pool_indices[b])
    if ratio == 128 or addr.use_req_ring:
        return rid * addr.ring_size + pos % addr.ring_size
    swa = int(addr.full_to_swa[int(addr.req_to_token[rid, pos])])
    return (swa // addr.swa_page_size) * addr.ring_size + swa % addr.ring_size


def write_pad(ratio: int, ring_size: int) -> int:
    """Trailing tokens the write plan keeps resident (`mtp_pad` in `plan_compress_prefill`)."""
    window = ratio * (2 if ratio == 4 else 1)
    return ring_size - window + 2 if ring_size > window else 0


def should_write_state(
    ratio: int, pos: int, seq_len: int, ring_size: int, swa_page_size: int, use_req_ring: bool
) -> bool:
    """Whether token `pos` of a request now `seq_len` long is written to the state ring."""
    last_c_pos = seq_len // ratio * ratio
    first_w_pos = min(
        last_c_pos - (ratio if ratio == 4 else 0), seq_len - write_pad(ratio, ring_size)
    )
    if pos >= first_w_pos:
        return True
    return ratio == 4 and not use_req_ring and pos % swa_page_size >= swa_page_size - ratio


def compress_plans_reference(
    verify_lens: list[int],
    prefix_lens: list[int],
    ratio: int,
    addr: StateAddressing,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's compact prefill plans for a verify batch, in `plan_compress_prefill` order.

    Returns `plan_c` int64 `[num_c, 5]` (seq_len, ragged_id, buffer_len, read_page_0,
    read_page_1; `-1, batch index` when buffer_len is 0, as SGLang leaves them) and `plan_w` int64
    `[num_w, 2]` (ragged_id, write_loc).
    """
    window = ratio * (2 if ratio == 4 else 1)
    plan_c, plan_w = [], []
    ragged = 0
    for b, (n, prefix) in enumerate(zip(verify_lens, prefix_lens)):
        seq_len = prefix + n
        for j in range(n):
            pos = prefix + j
            if (pos + 1) % ratio == 0:
                buffer_len = window - min(j + 1, window)
                pages = [-1, b]  # SGLang fills the read pages only when the ring is read
                if buffer_len > 0:
                    pages = [
                        state_slot(addr, ratio, b, max(pos - ratio, 0)) // ratio,
                        state_slot(addr, ratio, b, pos) // ratio,
                    ]
                plan_c.append([pos + 1, ragged + j, buffer_len, *pages])
            if should_write_state(
                ratio, pos, seq_len, addr.ring_size, addr.swa_page_size, addr.use_req_ring
            ):
                plan_w.append([ragged + j, state_slot(addr, ratio, b, pos)])
        ragged += n
    as_tensor = lambda rows, width: torch.tensor(rows, dtype=torch.int64).view(-1, width)
    return as_tensor(plan_c, 5), as_tensor(plan_w, 2)


def pack_compress_plans(plan_c: torch.Tensor, plan_w: torch.Tensor):
    """The 16-byte `CompressPlan` / 8-byte `WritePlan` structs (`compress_v2.cuh`) as uint8."""
    c = plan_c.to(torch.int64)
    words = torch.stack([c[:, 0], c[:, 1] | (c[:, 2] << 16), c[:, 3], c[:, 4]], dim=1)
    return _u32_bytes(words & 0xFFFFFFFF), _u32_bytes(plan_w.to(torch.int64) & 0xFFFFFFFF)


def _u32_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 `[n, k]` holding uint32 values -> little-endian uint8 `[n, 4k]`."""
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64)
    return (
        ((words[..., None] >> shifts) & 0xFF)
        .to(torch.uint8)
        .reshape(words.shape[0], 4 * words.shape[1])
    )
