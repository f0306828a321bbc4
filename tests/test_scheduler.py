"""The prefix scheduler: Algorithm 1, the asynchronous variant, static mode (DSPARK.md 3)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.speculative.dspark_components.dspark_sps import (
    SpsAdditiveCostTable,
    SpsCostTable,
)

from sglang_dspark.scheduling.scheduler import (
    expected_throughput,
    greedy_path,
    load_sps_table,
    save_sps_table,
    schedule_async,
    schedule_static,
    schedule_sync,
    sps_table_from_points,
    steps_per_sec,
    survival,
    sync_may_verify,
    top_k_lengths,
    verify_capacity,
)
from sglang_dspark.verification.rejection import chain_rejection_sample

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# Appendix A: the early stop keeps the scheduler lossless


A, B = 0, 1
P_T = torch.tensor([0.7, 0.3])
P_D = torch.tensor([0.5, 0.5])
APPENDIX_SPS = sps_table_from_points([1, 2, 3], [1.0, 0.5, 0.45])


def _c2(x1: torch.Tensor) -> torch.Tensor:
    """c_2 depends on the sampled x_1 (the Markov embedding): A -> 0.9, B -> 0."""
    return torch.where(x1 == A, 0.9, 0.0).double()


def _first_output_token(lengths, drafts, gen) -> torch.Tensor:
    """Verify `lengths[i]` drafts of trial i by rejection sampling; return the first token out."""
    n_trials, gamma = drafts.shape
    out = torch.empty(n_trials, dtype=torch.int64)
    for ell in range(gamma + 1):  # a loop over the few possible lengths, not over trials
        rows = (lengths == ell).nonzero().flatten()
        if rows.numel() == 0:
            continue
        if ell == 0:  # anchor only: the target samples the next token itself
            out[rows] = torch.multinomial(P_T, rows.numel(), replacement=True, generator=gen)
            continue
        n_acc, nxt = chain_rejection_sample(
            drafts[rows, :ell],
            P_T.expand(rows.numel(), ell + 1, 2),
            P_D.expand(rows.numel(), ell, 2),
            generator=gen,
        )
        out[rows] = torch.where(n_acc >= 1, drafts[rows, 0], nxt)
    return out


def _appendix_trial_lengths(schedule, x1: torch.Tensor) -> torch.Tensor:
    """Every trial is its own R = 1 problem; c takes two values, so schedule each once."""
    l_by_x1 = {
        tok: int(schedule(torch.tensor([[0.8, float(_c2(torch.tensor(tok)))]]))[0])
        for tok in (A, B)
    }
    return torch.where(x1 == A, l_by_x1[A], l_by_x1[B])


def _simulate(schedule, n_trials: int = 200_000, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(P_D, 2 * n_trials, replacement=True, generator=gen)
    drafts = drafts.view(n_trials, 2)
    lengths = _appendix_trial_lengths(schedule, drafts[:, 0])
    first = _first_output_token(lengths, drafts, gen)
    return float((first == A).double().mean())


def test_appendix_a_numbers():
    c_a = torch.tensor([[0.8, 0.9]])
    c_b = torch.tensor([[0.8, 0.0]])
    # Theta_1 = 1.8 * 0.5 = 0.9 < Theta_0 = 1.0: Algorithm 1 stops before looking at c_2.
    assert schedule_sync(c_a, APPENDIX_SPS).tolist() == [0]
    assert schedule_sync(c_b, APPENDIX_SPS).tolist() == [0]
    # Without the early stop: Theta_2 = 2.52 * 0.45 = 1.134 > 1.0 for x_1 = A only.
    assert expected_throughput(c_a, torch.tensor([2]), APPENDIX_SPS) == pytest.approx(1.134)
    assert schedule_async(c_a, c_a, APPENDIX_SPS).tolist() == [2]
    assert schedule_async(c_b, c_b, APPENDIX_SPS).tolist() == [0]


def test_appendix_a_early_stop_is_lossless_and_no_stop_is_not():
    freq = _simulate(lambda c: schedule_sync(c, APPENDIX_SPS))
    freq_no_stop = _simulate(lambda c: schedule_async(c, c, APPENDIX_SPS))
    assert abs(freq - 0.7) < 0.01, freq
    assert abs(freq_no_stop - 0.85) < 0.01, freq_no_stop


def test_appendix_a_async_with_lagged_confidences_is_lossless():
    """K from an independent earlier step's confidences cannot see the current x_1."""
    n_trials = 200_000
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(P_D, 2 * n_trials, replacement=True, generator=gen)
    drafts = drafts.view(n_trials, 2)
    lagged_x1 = torch.multinomial(P_D, n_trials, replacement=True, generator=gen)
    lengths = torch.empty(n_trials, dtype=torch.int64)
    for lag_tok, now_tok in itertools.product((A, B), (A, B)):
        c_lag = torch.tensor([[0.8, float(_c2(torch.tensor(lag_tok)))]])
        c_now = torch.tensor([[0.8, float(_c2(torch.tensor(now_tok)))]])
        ell = int(schedule_async(c_lag, c_now, APPENDIX_SPS)[0])
        lengths[(lagged_x1 == lag_tok) & (drafts[:, 0] == now_tok)] = ell
    assert set(lengths.tolist()) == {0, 1, 2}  # the search did jump the cliff sometimes
    freq = float((_first_output_token(lengths, drafts, gen) == A).double().mean())
    assert abs(freq - 0.7) < 0.01, freq


# ---------------------------------------------------------------------------------------------
# Algorithm 1 against a literal, loop-based reading of the paper


def algorithm1_reference(c: torch.Tensor, table) -> tuple[list[int], list[tuple[int, int]]]:
    """DSPARK.md section 3, line by line. Returns (lengths, admitted candidates in order)."""
    R, gamma = c.shape
    a = survival(c).tolist()

    def sps(b: int) -> float:
        return float(steps_per_sec(table, torch.tensor([b]), R)[0])

    cands = [(a[r][j], r, j) for r in range(R) for j in range(gamma) if a[r][j] > 0]
    cands.sort(key=lambda t: (-t[0], t[2], t[1]))
    lengths, admitted = [0] * R, []
    b, tau = R, float(R)
    theta_best = tau * sps(b)
    for a_rj, r, j in cands:
        b, tau = b + 1, tau + a_rj
        theta = tau * sps(b)
        if theta > theta_best:
            theta_best = theta
            lengths[r] = j + 1
            admitted.append((r, j + 1))
        else:
            break
    return lengths, admitted


confidence = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),  # ties and zeros
    st.floats(0.0, 1.0, allow_nan=False),
)


@st.composite
def problems(draw, max_r=4, max_gamma=4, jagged=True):
    R = draw(st.integers(1, max_r))
    gamma = draw(st.integers(1, max_gamma))
    c = torch.tensor(
        draw(
            st.lists(st.lists(confidence, min_size=gamma, max_size=gamma), min_size=R, max_size=R)
        ),
        dtype=torch.float64,
    )
    max_b = R * (gamma + 1)
    if jagged:  # any positive steps/s, on a random subset of probes (floor lookup)
        probes = sorted(draw(st.sets(st.integers(1, max_b), min_size=1, max_size=max_b)))
        values = draw(st.lists(st.floats(0.05, 2.0), min_size=len(probes), max_size=len(probes)))
    else:  # SPS(B) = 1 / (alpha + beta * B): step time affine in the batch tokens
        alpha = draw(st.floats(0.01, 10.0))
        beta = draw(st.floats(0.01, 10.0))
        probes = list(range(1, max_b + 1))
        values = [1.0 / (alpha + beta * b) for b in probes]
    return c, sps_table_from_points(probes, values)


def _is_prefix_set(admitted, lengths) -> bool:
    chosen = set(admitted)
    return chosen == {(r, j) for r, ell in enumerate(lengths) for j in range(1, ell + 1)}


@settings(max_examples=300, deadline=None)
@given(problems())
def test_sync_matches_reference_and_is_prefix_consistent(problem):
    c, table = problem
    lengths = schedule_sync(c, table)
    ref_lengths, admitted = algorithm1_reference(c, table)
    assert lengths.tolist() == ref_lengths
    assert _is_prefix_set(admitted, ref_lengths)  # (r, j) admitted only after (r, 1..j-1)
    assert lengths.dtype == torch.int64
    assert bool((lengths >= 0).all()) and bool((lengths <= c.shape[1]).all())
    assert c.shape[0] + int(lengths.sum()) >= c.shape[0]  # B >= R: every anchor verified
    # The same lengths come out of a top-K with K = sum(l): a synchronous mode can reuse
    # SGLang's top-K kernel with this budget.
    assert top_k_lengths(c, int(lengths.sum())).tolist() == ref_lengths


@settings(max_examples=400, deadline=None)
@given(problems(max_r=5, max_gamma=6), st.data())
def test_the_draft_pass_drafts_exactly_the_longest_verified_window(problem, data):
    """The draft pass drafts position k while `sync_may_verify` of positions 0..k says yes: it
    says yes exactly when Algorithm 1 verifies position k for some request, so the pass drafts
    exactly the longest window any request verifies, whatever the confidences after the
    stop (k's own is known when the pass decides); its lengths with positions from the stop
    on at 0 are its lengths."""
    c, table = problem
    gamma = c.shape[1]
    stop = next((k for k in range(gamma) if not sync_may_verify(c[:, : k + 1], table)), gamma)
    lengths = schedule_sync(c, table)
    assert int(lengths.max()) == stop
    later = torch.tensor(data.draw(st.lists(confidence, min_size=c.numel(), max_size=c.numel())),
                         dtype=torch.float64).view_as(c)  # fmt: skip
    other = torch.where(torch.arange(gamma)[None, :] > stop, later, c)
    assert schedule_sync(other, table).tolist() == lengths.tolist()
    cut = torch.where(torch.arange(gamma)[None, :] >= stop, torch.zeros_like(c), c)
    assert schedule_sync(cut, table).tolist() == lengths.tolist()


def test_drafting_goes_on_while_a_request_may_still_verify():
    """Confident requests under a flat SPS (verifying is free): every position may be verified;
    a batch whose first drafts do not pay under a steep SPS stops at once."""
    c = torch.full((3, 5), 0.9, dtype=torch.float64)
    flat = sps_table_from_points([1, 64], [1.0, 1.0])
    assert all(sync_may_verify(c[:, : k + 1], flat) for k in range(5))
    steep = sps_table_from_points(list(range(1, 20)), [1.0 / b for b in range(1, 20)])
    low = torch.full((3, 5), 0.2, dtype=torch.float64)
    assert not sync_may_verify(low[:, :2], steep)
    assert schedule_sync(low, steep).tolist() == [0, 0, 0]
    assert not sync_may_verify(torch.zeros(2, 1, dtype=torch.float64), flat)


def _path_thetas(c, table) -> list[float]:
    """Theta after admitting the first m candidates of the greedy path, m = 0..N."""
    a_path, _ = greedy_path(survival(c))
    return [expected_throughput(c, top_k_lengths(c, m), table) for m in range(a_path.numel() + 1)]


def _brute_force_best(c, table) -> float:
    R, gamma = c.shape
    return max(
        expected_throughput(c, torch.tensor(ls), table)
        for ls in itertools.product(range(gamma + 1), repeat=R)
    )


def _unimodal(xs: list[float]) -> bool:
    """Strictly increasing, then never increasing again."""
    i = 0
    while i + 1 < len(xs) and xs[i + 1] > xs[i]:
        i += 1
    return all(xs[k + 1] <= xs[k] for k in range(i, len(xs) - 1))


@settings(max_examples=200, deadline=None)
@given(problems(max_r=3, max_gamma=3, jagged=True))
def test_sync_is_the_path_optimum_when_theta_is_unimodal(problem):
    c, table = problem
    thetas = _path_thetas(c, table)
    got = expected_throughput(c, schedule_sync(c, table), table)
    assert got <= max(thetas) + 1e-12
    if _unimodal(thetas):
        assert got == pytest.approx(max(thetas), rel=1e-12, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(problems(max_r=3, max_gamma=3, jagged=True))
def test_path_optimum_is_global_for_non_increasing_sps(problem):
    """For fixed B the top survivals are a prefix set, so the greedy path holds the global
    optimum whenever SPS does not rise with B (padding with zero-survival drafts never pays)."""
    c, table = problem
    values = table.sample_steps_per_sec
    table = sps_table_from_points(table.sample_batch_tokens, sorted(values, reverse=True))
    best = _brute_force_best(c, table)
    assert max(_path_thetas(c, table)) == pytest.approx(best, rel=1e-12, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(problems(max_r=3, max_gamma=3, jagged=False))
def test_sync_is_global_optimum_for_affine_step_time(problem):
    """SPS = 1/(alpha + beta B): Theta is (concave tau)/(affine) along the path, hence
    unimodal, and Algorithm 1's early stop finds the brute-force optimum."""
    c, table = problem
    got = expected_throughput(c, schedule_sync(c, table), table)
    assert got == pytest.approx(_brute_force_best(c, table), rel=1e-9)


# ---------------------------------------------------------------------------------------------
# The asynchronous variant


positive_confidence = st.floats(1e-3, 1.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(problems(), st.data())
def test_async_capacity_never_depends_on_current_confidences(problem, data):
    c_lagged, table = problem
    R, gamma = c_lagged.shape
    k = verify_capacity(c_lagged, table)
    for _ in range(3):
        c_now = torch.tensor(
            data.draw(
                st.lists(
                    st.lists(positive_confidence, min_size=gamma, max_size=gamma),
                    min_size=R,
                    max_size=R,
                )
            ),
            dtype=torch.float64,
        )
        lengths = schedule_async(c_lagged, c_now, table)
        assert int(lengths.sum()) == min(k, R * gamma)  # K extra tokens, whatever c_now is
        # The chosen set is the top-K of a_now and a prefix set per request.
        a = survival(c_now)
        chosen = torch.arange(gamma)[None, :] < lengths[:, None]
        if bool(chosen.any()) and bool((~chosen).any()):
            assert float(a[chosen].min()) >= float(a[~chosen].max())


@settings(max_examples=100, deadline=None)
@given(problems())
def test_async_counts_only_candidates_with_positive_survival(problem):
    c, table = problem
    k = verify_capacity(torch.ones_like(c), table)
    lengths = schedule_async(torch.ones_like(c), c, table)
    n_positive = int((survival(c) > 0).sum())
    assert int(lengths.sum()) == min(k, n_positive)


def test_capacity_is_unconstrained_argmax_jumping_a_cliff():
    # SPS halves at B = 2, then stays flat: an early stop would keep 0, the argmax takes all.
    table = sps_table_from_points([1, 2], [1.0, 0.5])
    c = torch.tensor([[0.99, 0.99, 0.99, 0.99]])
    assert schedule_sync(c, table).tolist() == [0]
    assert verify_capacity(c, table) == 4


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(problems(), st.data())
def test_async_matches_sglang_planner(problem, data):
    """Same K and the same lengths as SGLang's shipped planner and top-K reference."""
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import (
        schedule_verify_lens_topk,
    )
    from sglang.srt.speculative.dspark_components.dspark_planner import (
        DSparkScheduleConfig,
        compute_verify_token_budget,
    )

    _, table = problem
    R, gamma = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    dyadic = st.sampled_from([k / 8 for k in range(1, 9)])  # exact products and sums

    def draw_c():
        return torch.tensor(
            data.draw(
                st.lists(st.lists(dyadic, min_size=gamma, max_size=gamma), min_size=R, max_size=R)
            ),
            dtype=torch.float32,
        )

    c_lagged, c_now = draw_c(), draw_c()
    cfg = DSparkScheduleConfig(gamma=gamma)
    k = compute_verify_token_budget(
        history_survival_probs=torch.cumprod(c_lagged, 1), sps_table=table, cfg=cfg
    ).budget
    assert verify_capacity(c_lagged, table) == k
    theirs = schedule_verify_lens_topk(confidence=c_now, budget=k, cfg=cfg)
    # SGLang counts the anchor: its verify_lens are 1 + l.
    assert theirs.long().tolist() == (1 + schedule_async(c_lagged, c_now, table)).tolist()


# ---------------------------------------------------------------------------------------------
# Static mode, SPS tables, batching


@settings(max_examples=200, deadline=None)
@given(problems(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_static_is_monotone_in_threshold(problem, t1, t2):
    c, _ = problem
    lo, hi = sorted((t1, t2))
    assert bool((schedule_static(c, hi) <= schedule_static(c, lo)).all())
    assert schedule_static(c, 0.0).tolist() == [c.shape[1]] * c.shape[0]
    assert bool((schedule_static(c, hi) >= 0).all())


def test_static_counts_leading_positions():
    c = torch.tensor([[0.9, 0.9, 0.9], [0.5, 1.0, 1.0], [0.2, 1.0, 1.0]])
    # a = [[.9, .81, .729], [.5, .5, .5], [.2, .2, .2]]
    assert schedule_static(c, 0.8).tolist() == [2, 0, 0]
    assert schedule_static(c, 0.5).tolist() == [3, 3, 0]
    assert schedule_static(c, 1.01).tolist() == [0, 0, 0]


def test_steps_per_sec_matches_sglang_lookups():
    table = SpsCostTable(
        sample_batch_tokens=[4, 8, 32], sample_steps_per_sec=[50.0, 40.0, 10.0], max_batch_tokens=64
    )
    bs = torch.arange(1, 70)
    got = steps_per_sec(table, bs, num_requests=3)
    assert got.tolist() == [table.lookup(int(b)) for b in bs]
    add = SpsAdditiveCostTable(
        bias_seconds=0.01,
        bs_probes=[1, 8, 64],
        alpha_seconds=[0.001, 0.002, 0.01],
        m_probes=[1, 16, 128],
        theta_seconds=[0.0, 0.004, 0.05],
    )
    for r in (1, 5, 100):
        got = steps_per_sec(add, bs, num_requests=r)
        want = [1.0 / add.step_time(num_reqs=r, budget=int(b) - r) for b in bs]
        assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_sps_table_roundtrip_through_sglang_files(tmp_path):
    table = sps_table_from_points([8, 1, 2], [0.4, 1.0, 0.9])
    path = tmp_path / "sps.json"
    save_sps_table(table, path)
    assert json.loads(path.read_text()) == {
        "sample_batch_tokens": [1, 2, 8],
        "sample_steps_per_sec": [1.0, 0.9, 0.4],
        "max_batch_tokens": 8,
    }
    assert load_sps_table(path) == table
    add = SpsAdditiveCostTable(
        bias_seconds=0.01,
        bs_probes=[1],
        alpha_seconds=[0.0],
        m_probes=[1, 9],
        theta_seconds=[0.0, 0.01],
    )
    save_sps_table(add, path)
    assert load_sps_table(path) == add


def test_batched_call_large_r():
    gen = torch.Generator().manual_seed(0)
    R, gamma = 256, 7
    c = torch.rand(R, gamma, generator=gen, dtype=torch.float64) ** 0.3
    probes = list(range(1, R * (gamma + 1) + 1, 16))
    table = sps_table_from_points(probes, [1.0 / (0.02 + 1e-5 * b) for b in probes])
    for lengths in (
        schedule_sync(c, table),
        schedule_async(c.flip(0), c, table),
        schedule_static(c, 0.5),
    ):
        assert lengths.shape == (R,)
        assert bool(((lengths >= 0) & (lengths <= gamma)).all())
    ref, _ = algorithm1_reference(c, table)
    assert schedule_sync(c, table).tolist() == ref
    # A lighter step-time slope verifies more: the budget adapts to load.
    light = sps_table_from_points(probes, [1.0 / (0.02 + 1e-7 * b) for b in probes])
    assert int(schedule_sync(c, light).sum()) > int(schedule_sync(c, table).sum())


def test_rejects_bad_shapes():
    table = sps_table_from_points([1], [1.0])
    with pytest.raises(ValueError, match=r"\[R, gamma\]"):
        schedule_sync(torch.ones(3), table)
    with pytest.raises(ValueError, match="same requests"):
        schedule_async(torch.ones(2, 3), torch.ones(3, 3), table)
