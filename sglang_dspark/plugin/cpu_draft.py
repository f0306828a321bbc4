"""`cpu_draft_until_verifiable`: the CPU draft pass drafts only what Algorithm 1 can verify.

SGLang's draft pass (`DraftBlockProposer.propose`, eager path) projects all gamma draft
positions through the 49k-word LM head, runs all gamma Markov steps, and only then asks the
confidence head and the scheduler how many drafts each request verifies. At 4 users, T=1 the
mean verify window is about 3 slots of 8 (anchor included) and positions 5-7 are verified in
well under 1% of rounds, yet they cost as much as the first.

With `SGLANG_DSPARK_SCHEDULER=sync` on a CPU device this hook runs the Markov steps position
by position: the confidence of position k needs only the drafts before it (the head reads the
hidden state and the Markov embedding of the previous token), so before position k's Markov
step it asks `scheduler.sync_may_verify` whether Algorithm 1 verifies position k for any
request, which the confidences of positions 0..k decide exactly; at the first position where
no request does, the pass stops. So it drafts exactly the longest window the step verifies.
The LM head still projects all gamma positions in one call: on a CPU it is bound by reading
its weight (57 MB in bf16 for SmolLM2), once per call, so one call per position cost more
than it saved (measured: 24 ms against 6 ms at 4 users, `benchmarks/profile_round.py`).
Positions not drafted get confidence 0 (raw logit the dtype's minimum), which leaves
Algorithm 1's lengths unchanged, token 0 and step logits 0, and are never read: the verify
window ends before them, the greedy accept caps there and draws its bonus from the target, and
the sampled accept reads only verified rows (`cpu_verified_rows_accept`, required for T > 0).

The confidences are computed with the head's own call on the whole [bs, gamma] block each
step (positions after the current one are filled), so the values the scheduler sees are
those of SGLang's single call, bit for bit (tests/test_draft_early_stop.py serves both).
Falls back to SGLang's pass for anything else: another scheduler mode, a CUDA device, a draft
graph or sampler, no confidence head, a forced budget fraction, a vocabulary split over TP
ranks, batches that sample with top-k / top-p, and every sampled batch when the verified-rows
accept is off.
`SGLANG_DSPARK_DRAFT_EARLY_STOP=0` turns it off for a side-by-side measurement.
"""

from __future__ import annotations

import os

from sglang_dspark.plugin.registry import register_after, register_around

PROPOSE = "sglang.srt.speculative.dspark_components.dspark_draft.DraftBlockProposer.propose"
WORKER_INIT = "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2.__init__"
SWITCH_ENV = "SGLANG_DSPARK_DRAFT_EARLY_STOP"
PLANNER_ATTR = "_dspark_verify_planner"  # the worker's verify planner, on its proposer
VOCAB_ENV = "SGLANG_DSPARK_DRAFT_VOCAB"
VOCAB_ATTR = "_dspark_draft_vocab"  # the proposer's draft vocabulary (None: the full one)


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1").strip() not in ("0", "false", "off", "no")


def _link_planner(result, worker, *args, **kwargs):
    proposer = getattr(worker, "_proposer", None)
    if proposer is not None:
        setattr(proposer, PLANNER_ATTR, getattr(worker, "_verify_planner", None))


def _budget_planner(proposer):
    planner = getattr(proposer, PLANNER_ATTR, None)
    budget = getattr(planner, "_budget_planner", None)
    if budget is None or getattr(budget, "forced_budget_frac", None) is not None:
        return None
    if getattr(budget, "sps_table", None) is None:
        return None
    return budget


def _applies(proposer, budget, sampling_info, device) -> bool:
    import torch

    from sglang_dspark.plugin import cpu_accept
    from sglang_dspark.plugin.scheduling import scheduler_mode

    model = proposer.draft_model
    if not (
        enabled()
        and budget is not None
        and torch.device(device).type == "cpu"
        and scheduler_mode() == "sync"
        and proposer._draft_sampler is None
        and getattr(model, "confidence_head", None) is not None
        and getattr(model.markov_head, "vocab_shard", None) is None
    ):
        return False
    sampled = sampling_info is not None and not sampling_info.is_all_greedy
    return not sampled or cpu_accept.applies(sampling_info, torch.device(device))


def _propose(
    original,
    proposer,
    *,
    batch,
    draft_input,
    verify_window,
    bs,
    device,
    target_model,
    sampling_info,
    anchor_prepared=False,
):
    kwargs = {
        "batch": batch,
        "draft_input": draft_input,
        "verify_window": verify_window,
        "bs": bs,
        "device": device,
        "target_model": target_model,
        "sampling_info": sampling_info,
        "anchor_prepared": anchor_prepared,
    }
    budget = _budget_planner(proposer)
    if not _applies(proposer, budget, sampling_info, device):
        return original(proposer, **kwargs)
    from sglang_dspark.plugin import plain_rounds

    if (
        plain_rounds.wanted(proposer)
        and plain_rounds.compact_verify(getattr(proposer, PLANNER_ATTR, None))
        and int(budget.cfg.min_verify_len) <= 1
        and getattr(proposer, "deferred_commit", None) is None
    ):
        return plain_rounds.plain_proposal(
            proposer, draft_input=draft_input, bs=bs, device=device,
            sampling_info=sampling_info, anchor_prepared=anchor_prepared,
        )  # fmt: skip
    import torch
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftBlockResult,
        DraftProposal,
        _draft_step,
        resolve_draft_params,
    )
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

    from sglang_dspark.plugin.cpu_markov import stream_seed
    from sglang_dspark.scheduling.scheduler import sync_may_verify

    model = proposer.draft_model
    markov = model.markov_head
    gamma = proposer.gamma
    embed_module = unwrap_lora_layer(
        model.embed_tokens if not proposer.sample_from_anchor
        else target_model.get_input_embeddings()
    )  # fmt: skip
    fwd = proposer._run_forward(
        batch=batch,
        draft_input=draft_input,
        verify_window=verify_window,
        bs=bs,
        device=device,
        embed_module=embed_module,
        draft_sampler=None,
        sampling_info=sampling_info,
        anchor_prepared=anchor_prepared,
    )
    block_ids = fwd.draft_block_ids
    anchor = block_ids[:, 0]
    # All positions through the LM head in one call: on a CPU it is bound by reading its 49k x
    # hidden weight, which one call reads once whatever the rows (a call per position read it
    # once per position and was slower than drafting everything).
    subset = _draft_vocab(proposer)
    if subset is None:
        with proposer._base_logits_context():
            base_logits, features = model.compute_base_logits(fwd.raw_hidden)
    else:
        features = fwd.raw_hidden
        base_logits = subset_base_logits(model, subset, features)
    base_logits = base_logits.view(bs, gamma, -1)
    params = resolve_draft_params(sampling_info=sampling_info, bs=bs, device=device)
    greedy = bool(proposer._greedy_draft)
    cfg = budget.cfg
    # Algorithm 1 looks at drafts 1..max_len; SGLang verifies at least min_verify_len slots
    max_len = min(gamma, int(cfg.resolved_max_verify_len()) - 1)
    floor = max(int(cfg.min_verify_len), 1) - 1

    tokens = torch.zeros((bs, gamma), dtype=torch.int64, device=device)
    logits_out = (
        None
        if greedy
        else torch.zeros(
            (bs, gamma, base_logits.shape[-1]),
            dtype=markov.step_logits_dtype(base_logits.dtype),
            device=base_logits.device,
        )
    )
    state = markov.init_state(fwd.draft_hidden_3d)
    prev = anchor.long()
    confidence = confidence_raw = None
    drafted = 0
    for k in range(gamma):
        # position k's confidence reads the drafts before k only; later columns are filler
        confidence, confidence_raw = model.compute_confidence(
            anchor_tokens=anchor, draft_tokens=tokens, confidence_features=features
        )
        if k >= max_len or (
            k >= floor and not sync_may_verify(confidence[:, : k + 1], budget.sps_table)
        ):
            break
        if subset is None:
            prev, state = _draft_step(
                markov,
                prev,
                base_logits[:, k],
                hidden_states=None if fwd.draft_hidden_3d is None else fwd.draft_hidden_3d[:, k],
                state=state,
                temperatures=params.step_temperatures,
                noise=proposer.noise,
                step=k,
                logits_out=None if greedy else logits_out[:, k],
            )
        else:
            prev = subset_step(
                markov,
                subset,
                prev,
                base_logits[:, k],
                temperatures=params.step_temperatures,
                seed=stream_seed(proposer.noise.key, int(proposer.noise.offset.item()), k),
                logits_out=None if greedy else logits_out[:, k],
            )
        prev = proposer._tp_sync.sync(SpecTpSyncSite.DSPARK_DRAFT, prev)
        tokens[:, k] = prev
        drafted = k + 1
    if not greedy:
        proposer.noise.offset.add_(1)  # one block drawn, as SGLang's pass counts
        if subset is not None:  # the accept reads the proposal over these target ids
            logits_out.dspark_draft_vocab = subset.ids
    if drafted < gamma:
        confidence = confidence.clone()
        confidence[:, drafted:] = 0.0
        confidence_raw = confidence_raw.clone()
        confidence_raw[:, drafted:] = torch.finfo(confidence_raw.dtype).min
    return DraftProposal(
        draft_block_ids=(
            block_ids if proposer.sample_from_anchor else block_ids[:, :gamma].contiguous()
        ),
        draft_block=DraftBlockResult(
            draft_tokens=tokens,
            corrected_logits=logits_out,
            greedy_mask=params.greedy_mask,
            temperatures=params.temperatures,
            greedy_draft=greedy,
        ),
        confidence=confidence,
        confidence_raw=confidence_raw,
    )


class DraftVocab:
    """The draft vocabulary's target ids [N] and the LM head and Markov W2 rows for them."""

    def __init__(self, ids, lm_weight, w2_weight) -> None:
        self.ids = ids
        self.lm_weight = lm_weight
        self.w2_weight = w2_weight


_UNSET = object()


def draft_vocab_path(proposer) -> str | None:
    """`SGLANG_DSPARK_DRAFT_VOCAB` (a file; `full` or 0: the whole vocabulary), else the draft
    checkpoint's own `draft_vocab/vocab.safetensors` when it ships one."""
    from pathlib import Path

    from sglang_dspark.drafter.formats.draft_vocab import FILE_NAME

    raw = os.environ.get(VOCAB_ENV, "").strip()
    if raw.lower() in ("full", "0", "off", "none"):
        return None
    if raw:
        return raw
    try:
        from sglang.srt.runtime_context import get_spec

        draft = get_spec().speculative_draft_model_path
    except Exception:  # noqa: BLE001 - no published spec config: no shipped vocabulary
        return None
    found = Path(draft or "") / FILE_NAME
    return str(found) if draft and found.is_file() else None


def _draft_vocab(proposer) -> DraftVocab | None:
    """The draft vocabulary to propose from (None: the full one), built once per proposer. A
    head it cannot restrict exactly (a quantized or TP-split LM head, a Markov head whose bias
    is not W2 times the previous token's embedding) drafts over the full vocabulary."""
    cached = getattr(proposer, VOCAB_ATTR, _UNSET)
    if cached is not _UNSET:
        return cached
    import logging

    from sglang_dspark.drafter.formats.draft_vocab import load_draft_vocab

    log = logging.getLogger(__name__)
    model = proposer.draft_model
    markov = model.markov_head
    vocab = None
    path = draft_vocab_path(proposer)
    if path is not None:
        ids = load_draft_vocab(path, int(markov.vocab_size))  # refuses a mismatched file
        lm_head = model.lm_head
        weight = getattr(lm_head, "weight", None)
        from sglang.srt.models import dspark as dspark_model

        exact = (
            weight is not None
            and weight.is_floating_point()
            and not dspark_model.should_apply_lm_head_quant_method(
                lm_head, getattr(lm_head, "quant_method", None)
            )
            and not getattr(dspark_model, "_DSPARK_FP8_LM_HEAD", False)
        )
        if (
            exact
            and getattr(model, "_base_logits_gatherer", None) is None
            and int(getattr(lm_head, "tp_size", 1)) == 1
            and markov.greedy_w2_weight() is not None
            and not os.environ.get("SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH")
        ):
            ids = ids.to(weight.device)
            vocab = DraftVocab(
                ids,
                weight.index_select(0, ids).contiguous(),
                markov.markov_w2.weight.index_select(0, ids).contiguous(),
            )
            log.info("DSpark draft vocabulary: %d of %d tokens (%s)", len(ids),
                     int(markov.vocab_size), path)  # fmt: skip
        else:
            log.warning("DSpark draft vocabulary %s not used: this drafter's LM head or Markov "
                        "head cannot be restricted exactly; drafting over the full vocabulary",
                        path)  # fmt: skip
    setattr(proposer, VOCAB_ATTR, vocab)
    return vocab


def subset_base_logits(model, vocab: DraftVocab, hidden):
    """The LM head's rows for the draft vocabulary (SGLang's `compute_base_logits` restricted:
    the same muP division, the same matmul)."""
    from sglang_dspark.plugin import cpu_gemm

    if getattr(model, "logits_mup_width_multiplier", None):
        hidden = hidden / model.logits_mup_width_multiplier
    return cpu_gemm.linear(hidden.to(vocab.lm_weight.dtype), vocab.lm_weight)


def subset_step(markov, vocab: DraftVocab, prev, base, *, temperatures, seed, logits_out):
    """One Markov step over the draft vocabulary: step logits base + W2[ids] e(prev) (rounded
    as SGLang's step rounds them), argmax rows at temperature 0, the others sampled at their
    temperature (`cpu_markov.sample_rows`). Returns target token ids."""
    from sglang_dspark.plugin import cpu_gemm
    from sglang_dspark.plugin.cpu_markov import sample_rows

    bias = cpu_gemm.linear(markov.get_prev_embeddings(prev), vocab.w2_weight)
    step_dtype = markov.step_logits_dtype(base.dtype)
    value = (base.float() + bias.float()).to(step_dtype).float()
    if logits_out is not None:
        logits_out.copy_(value)
    picked = value.argmax(-1)
    sampled = (temperatures != 0).nonzero()[:, 0]
    if len(sampled):
        picked[sampled] = sample_rows(value[sampled], temperatures[sampled], seed)
    return vocab.ids[picked]


def install() -> None:
    register_after(WORKER_INIT, _link_planner)
    register_around(PROPOSE, _propose)


HOOKS = {"cpu_draft_until_verifiable": install}
