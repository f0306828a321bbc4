"""`SGLANG_DSPARK_V4_KERNELS`: the V4 CPU hooks call `dspark_kernels`' references or its Triton
kernels (`sglang_dspark/plugin/v4_kernels.py`).

The switch itself (default, `triton`, a bad value, the launcher's TRITON_INTERPRET) is checked
in this process. Each routed call (SWA KV store, indexer query, compressor pooling + state
write, compressor stores) is compared with the reference path on small inputs: on CPU under
Triton's interpreter (in a child pytest, see `tests/kernel_interpreter.py`), on a GPU compiled
(the reference on the CPU copy of the same inputs). The tiny V4 served both ways:
`tests/test_v4_kernels_serving.py`.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from dspark_kernels.kv_layout import new_index_cache, new_v4_cache, read_index_rows
from kernel_interpreter import DEVICE, GPU, direct, interpreter_test

from sglang_dspark.plugin import v4_cpu_compressor, v4_cpu_norm_rope, v4_kernels

test_in_triton_interpreter = interpreter_test(__file__)


# ------------------------------------------------------------------------------ the switch
def test_default_is_reference(v4_switch, caplog):
    v4_switch(None)
    with caplog.at_level(logging.INFO, logger=v4_kernels.__name__):
        assert v4_kernels.v4_kernels() == "reference"
        assert v4_kernels.v4_kernels() == "reference"
    assert not v4_kernels.use_triton()
    logged = [r.getMessage() for r in caplog.records if "DeepSeek-V4 CPU kernels" in r.getMessage()]
    assert len(logged) == 1 and "torch references" in logged[0]  # read and logged once
    v4_switch("")
    assert v4_kernels.v4_kernels() == "reference"


def test_triton_selects_the_kernels(v4_switch, caplog):
    v4_switch(" Triton ")
    with caplog.at_level(logging.INFO, logger=v4_kernels.__name__):
        assert v4_kernels.v4_kernels() == "triton" and v4_kernels.use_triton()
    assert any("Triton kernels" in r.getMessage() for r in caplog.records)


def test_bad_value_names_variable_choices_and_fix(v4_switch):
    v4_switch("cuda")
    with pytest.raises(v4_kernels.V4KernelsConfigError) as err:
        v4_kernels.v4_kernels()
    message = str(err.value)
    assert "SGLANG_DSPARK_V4_KERNELS='cuda'" in message
    assert "reference, triton" in message and "or unset it" in message


def test_launcher_sets_the_interpreter_for_triton_only():
    env = {v4_kernels.ENV: "triton"}
    assert v4_kernels.ensure_interpreter_for_cpu(env) and env["TRITON_INTERPRET"] == "1"
    assert not v4_kernels.ensure_interpreter_for_cpu(env)  # already on
    plain = {}
    assert not v4_kernels.ensure_interpreter_for_cpu(plain) and "TRITON_INTERPRET" not in plain
    with pytest.raises(v4_kernels.V4KernelsConfigError, match="TRITON_INTERPRET='0'"):
        v4_kernels.ensure_interpreter_for_cpu({v4_kernels.ENV: "triton", "TRITON_INTERPRET": "0"})
    with pytest.raises(v4_kernels.V4KernelsConfigError, match="reference, triton"):
        v4_kernels.ensure_interpreter_for_cpu({v4_kernels.ENV: "fast"})


# ------------------------------------------------------------------------ the routed calls
def freqs_cis(max_pos: int) -> torch.Tensor:
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(32, dtype=torch.float64) / 32
    )
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.fixture
def no_references(monkeypatch):
    """Fail any torch reference (or the hook's torch pooling) the Triton route would call."""
    from dspark_kernels import indexer_query, kv_store

    def forbidden(*args, **kwargs):
        raise AssertionError("the triton route called a torch reference")

    for module, name in [
        (kv_store, "kv_norm_rope_store_reference"),
        (indexer_query, "indexer_query_reference"),
        (indexer_query, "index_k_store_reference"),
        (v4_cpu_compressor, "compress_forward_torch"),
    ]:
        monkeypatch.setattr(module, name, forbidden)


@direct
def test_swa_kv_store_matches_reference(request):
    torch.manual_seed(0)
    kv = (torch.randn(9, 640) * 3).bfloat16()[:, :512]  # strided rows, as SGLang's slices
    weight, freqs = torch.rand(512) + 0.5, freqs_cis(600)
    positions = torch.tensor([0, 1, 5, 255, 256, 300, 511, 7, 8])
    loc = torch.tensor([3, 4, 9, 255, 256, -1, 511, 100, 101])
    want = new_v4_cache(2, 256)
    v4_cpu_norm_rope.swa_kv_store(kv, weight, 1e-6, freqs, positions, loc, want, 256,
                                  kernels="reference")  # fmt: skip
    request.getfixturevalue("no_references")
    got = new_v4_cache(2, 256, device=DEVICE)
    v4_cpu_norm_rope.swa_kv_store(*on_device(kv, weight), 1e-6, *on_device(freqs, positions, loc),
                                  got, 256, kernels="triton")  # fmt: skip
    assert want.any() and torch.equal(got.cpu(), want)


@direct
def test_indexer_query_matches_reference(request):
    torch.manual_seed(1)
    q = torch.randn(7, 8, 128).bfloat16()
    weight = torch.randn(7, 8).bfloat16()
    positions, freqs = torch.tensor([0, 3, 4, 100, 101, 102, 255]), freqs_cis(256)
    want_q, want_w = v4_cpu_norm_rope.indexer_query_fp8(q, weight, 0.03, freqs, positions,
                                                        kernels="reference")  # fmt: skip
    request.getfixturevalue("no_references")
    got_q, got_w = v4_cpu_norm_rope.indexer_query_fp8(*on_device(q, weight), 0.03,
                                                      *on_device(freqs, positions),
                                                      kernels="triton")  # fmt: skip
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_w.cpu(), want_w)


@direct
def test_padding_position_reads_the_tables_last_row(request):
    """A row at position -1 (padding): the references' torch indexing ropes it with the
    table's last row; the Triton route must too (the kernels alone read before the table:
    other bytes on every run). Same bytes as the reference on every row, twice."""
    torch.manual_seed(3)
    freqs, positions = freqs_cis(16), torch.tensor([0, -1, 5, -1])
    kv, weight = torch.randn(4, 512).bfloat16(), torch.rand(512) + 0.5
    q, head_weight = torch.randn(4, 8, 128).bfloat16(), torch.randn(4, 8).bfloat16()
    loc = torch.tensor([1, 2, 3, 4])
    want = new_v4_cache(1, 256)
    v4_cpu_norm_rope.swa_kv_store(kv, weight, 1e-6, freqs, positions, loc, want, 256,
                                  kernels="reference")  # fmt: skip
    want_q, want_w = v4_cpu_norm_rope.indexer_query_fp8(q, head_weight, 0.03, freqs, positions,
                                                        kernels="reference")  # fmt: skip
    request.getfixturevalue("no_references")
    for _ in range(2):
        got = new_v4_cache(1, 256, device=DEVICE)
        v4_cpu_norm_rope.swa_kv_store(*on_device(kv, weight), 1e-6,
                                      *on_device(freqs, positions, loc), got, 256,
                                      kernels="triton")  # fmt: skip
        assert torch.equal(got.cpu(), want)
        got_q, got_w = v4_cpu_norm_rope.indexer_query_fp8(*on_device(q, head_weight), 0.03,
                                                          *on_device(freqs, positions),
                                                          kernels="triton")  # fmt: skip
        assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got_w.cpu(), want_w)


@direct
def test_hooks_follow_the_variable(v4_switch):
    """The hooks' own entry points read the variable: the same bytes either way."""
    torch.manual_seed(2)
    kv, weight = torch.randn(4, 512), torch.rand(512) + 0.5
    freqs, positions, loc = freqs_cis(16), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 9])
    caches = {}
    for value in ("reference", "triton"):
        v4_switch(value)
        caches[value] = new_v4_cache(1, 256)
        v4_cpu_norm_rope._k_norm_rope_store(None, kv, weight, 1e-6, freqs, positions, loc,
                                            caches[value], 256)  # fmt: skip
    assert caches["reference"].any() and torch.equal(caches["triton"], caches["reference"])


def fake_pool(num_slots: int, ring_size: int):
    return SimpleNamespace(full_to_swa_index_mapping=torch.arange(num_slots), swa_page_size=256,
                           get_ring_size=lambda compress_ratio: ring_size,
                           _unified_kv=False)  # fmt: skip


# C4: 6 tokens after 5 cached (window reaching into the state ring) and a fresh 9-token prompt
# (a first group without overlap); C128: two blocks closing position 127 from the ring
C4_BATCH = ([5, 0], [6, 9])
C128_BATCH = ([124, 120], [6, 8])


def compressor_case(ratio: int, head_dim: int, input_dtype=torch.float32):
    prefix, extend = C4_BATCH if ratio == 4 else C128_BATCH
    seq = [p + e for p, e in zip(prefix, extend)]
    req_to_token = torch.zeros(2, 256, dtype=torch.int32)
    req_to_token[0, : seq[0]] = torch.arange(seq[0])
    req_to_token[1, : seq[1]] = torch.arange(256, 256 + seq[1])
    ring = 8 if ratio == 4 else 128
    coff = 2 if ratio == 4 else 1
    torch.manual_seed(ratio + head_dim)
    return SimpleNamespace(
        ratio=ratio, head_dim=head_dim, prefix=prefix, extend=extend, seq=seq,
        req_to_token=req_to_token, pool=fake_pool(512, ring),
        kv_score=torch.randn(sum(extend), coff * 2 * head_dim).to(input_dtype),
        state=torch.randn(2 * 2 * ring, coff * 2 * head_dim),  # old tokens in every row
        ape=torch.randn(coff * ratio, head_dim), weight=torch.rand(head_dim) + 0.5,
        freqs=freqs_cis(512), out_loc=torch.arange(sum(extend)) // ratio + 3,
    )  # fmt: skip


def compressor_plan(case, kernels: str, device: str):
    return v4_cpu_compressor.plan_on_cpu(
        case.ratio, is_prefill=True, token_to_kv_pool=case.pool,
        req_to_token=case.req_to_token.to(device), req_pool_indices=torch.tensor([0, 1], device=device),
        seq_lens=torch.tensor(case.seq, device=device), seq_lens_cpu=case.seq,
        extend_lens_cpu=case.extend, kernels=kernels,
    )  # fmt: skip


def run_compressor(case, kernels: str, device: str):
    """The two routed calls of one compressor layer: (rows, state, cache) on the CPU."""
    pool = case.pool
    if device != "cpu":
        pool = SimpleNamespace(**{**vars(pool), "full_to_swa_index_mapping":
                                  pool.full_to_swa_index_mapping.to(device)})  # fmt: skip
    case = SimpleNamespace(**{**vars(case), "pool": pool})
    plan = compressor_plan(case, kernels, device)
    state = case.state.clone().to(device)
    forward = (
        v4_cpu_compressor.compress_forward_triton
        if kernels == "triton"
        else v4_cpu_compressor.compress_forward_torch
    )
    rows = forward(state.view(-1, 2, state.shape[-1]), case.kv_score.to(device),
                   case.ape.to(device), plan, head_dim=case.head_dim,
                   compress_ratio=case.ratio)  # fmt: skip
    if case.head_dim == 512:
        cache = new_v4_cache(2, 64 if case.ratio == 4 else 2, device=device)
        page = 64 if case.ratio == 4 else 2
    else:
        cache, page = new_index_cache(2, device=device), 64
    v4_cpu_compressor.compress_norm_rope_store_torch(
        rows, plan, norm_weight=case.weight.to(device), norm_eps=1e-6,
        freq_cis=case.freqs.to(device), out_loc=case.out_loc.to(device), kvcache=cache,
        page_size=page, kernels=kernels,
    )  # fmt: skip
    return rows.cpu(), state.cpu(), cache.cpu()


COMPRESSORS = [
    pytest.param(4, 512, torch.float32, id="c4-kv"),
    pytest.param(4, 512, torch.bfloat16, id="c4-kv-bf16"),
    pytest.param(4, 128, torch.float32, id="c4-indexer"),
    pytest.param(128, 512, torch.float32, id="c128-kv", marks=pytest.mark.slow),
]


@direct
@pytest.mark.parametrize("ratio,head_dim,input_dtype", COMPRESSORS)
def test_compressor_matches_reference(ratio, head_dim, input_dtype, request):
    """Pooled rows, state ring and compressed cache: the Triton route against the torch
    route of the same hook. Rows: float32 sums in another order (within 1e-5); state: equal;
    V4 cache: equal; indexer cache: the fp8 codes of the Hadamard-rotated rows may flip one
    step where a value sits on a rounding boundary (`kernels/README.md`), scales close."""
    case = compressor_case(ratio, head_dim, input_dtype)
    want_rows, want_state, want_cache = run_compressor(case, "reference", "cpu")
    request.getfixturevalue("no_references")
    got_rows, got_state, got_cache = run_compressor(case, "triton", DEVICE)
    assert want_rows.shape[0] == {4: 3, 128: 2}[ratio]  # groups closed in this batch
    if input_dtype == torch.bfloat16:
        assert torch.equal(got_rows, want_rows)
    else:
        torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_state, want_state)
    assert want_cache.any()
    if head_dim == 512:
        assert torch.equal(got_cache, want_cache)
    else:
        loc = case.out_loc[v4_cpu_compressor.unpack_plan_c(
            compressor_plan(case, "reference", "cpu")[1])[:, 1]]  # fmt: skip
        got_codes, got_scale = read_index_rows(got_cache, loc)
        want_codes, want_scale = read_index_rows(want_cache, loc)
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-5, atol=0)
        assert (got_codes != want_codes).sum() <= 2


@direct
def test_triton_compressor_needs_its_plan():
    case = compressor_case(4, 512)
    plan = compressor_plan(case, "reference", "cpu")
    with pytest.raises(RuntimeError, match="SGLANG_DSPARK_V4_KERNELS=triton"):
        v4_cpu_compressor.compress_forward_triton(
            case.state.view(-1, 2, case.state.shape[-1]), case.kv_score, case.ape, plan,
            head_dim=512, compress_ratio=4,
        )  # fmt: skip


@pytest.mark.skipif(not GPU, reason="the compiled variant needs a CUDA GPU; none on this machine")
def test_gpu_runs_the_routed_calls_compiled():
    """On a GPU the comparisons above run here with CUDA tensors (`DEVICE`), compiled: the
    references on the CPU copies of the same inputs."""
    from dspark_kernels import compressor, indexer_query, kv_store
    from triton.runtime.interpreter import InterpretedFunction

    assert DEVICE == "cuda"
    for kernel in (kv_store._norm_rope_v4_store_kernel, indexer_query._indexer_query_kernel,
                   indexer_query._index_k_store_kernel, compressor._compress_kernel):  # fmt: skip
        assert not isinstance(kernel, InterpretedFunction)
