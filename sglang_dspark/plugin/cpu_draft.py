"""`cpu_draft_until_verifiable`: the CPU draft pass drafts only what Algorithm 1 can verify.

SGLang's draft pass (`DraftBlockProposer.propose`, eager path) projects all gamma draft
positions through the 49k-word LM head, runs all gamma Markov steps, and only then asks the
confidence head and the scheduler how many drafts each request verifies. At 4 users, T=1 the
mean verify window is about 3 slots of 8 (anchor included) and positions 5-7 are verified in
well under 1% of rounds, yet they cost as much as the first.

With `SGLANG_DSPARK_SCHEDULER=sync` on a CPU device this hook drafts position by position:
the confidence of position k needs only the drafts before it (the head reads the hidden state
and the Markov embedding of the previous token), so before position k's LM head and Markov
step it asks `scheduler.sync_may_verify` whether Algorithm 1 verifies position k for any
request, which the confidences of positions 0..k decide exactly; at the first position where
no request does, the pass stops. So it drafts exactly the longest window the step verifies.
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
    import torch
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftBlockResult,
        DraftProposal,
        _draft_step,
        resolve_draft_params,
    )
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

    from sglang_dspark.scheduler import sync_may_verify

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
    hidden = fwd.raw_hidden.view(bs, gamma, -1)
    params = resolve_draft_params(sampling_info=sampling_info, bs=bs, device=device)
    greedy = bool(proposer._greedy_draft)
    cfg = budget.cfg
    # Algorithm 1 looks at drafts 1..max_len; SGLang verifies at least min_verify_len slots
    max_len = min(gamma, int(cfg.resolved_max_verify_len()) - 1)
    floor = max(int(cfg.min_verify_len), 1) - 1

    tokens = torch.zeros((bs, gamma), dtype=torch.int64, device=device)
    logits_out = None
    state = markov.init_state(fwd.draft_hidden_3d)
    prev = anchor.long()
    confidence = confidence_raw = None
    drafted = 0
    for k in range(gamma):
        # position k's confidence reads the drafts before k only; later columns are filler
        confidence, confidence_raw = model.compute_confidence(
            anchor_tokens=anchor, draft_tokens=tokens, confidence_features=fwd.raw_hidden
        )
        if k >= max_len or (
            k >= floor and not sync_may_verify(confidence[:, : k + 1], budget.sps_table)
        ):
            break
        with proposer._base_logits_context():
            base, _ = model.compute_base_logits(hidden[:, k])
        if logits_out is None and not greedy:
            logits_out = torch.zeros(
                (bs, gamma, base.shape[-1]),
                dtype=markov.step_logits_dtype(base.dtype),
                device=base.device,
            )
        prev, state = _draft_step(
            markov,
            prev,
            base,
            hidden_states=None if fwd.draft_hidden_3d is None else fwd.draft_hidden_3d[:, k],
            state=state,
            temperatures=params.step_temperatures,
            noise=proposer.noise,
            step=k,
            logits_out=None if greedy else logits_out[:, k],
        )
        prev = proposer._tp_sync.sync(SpecTpSyncSite.DSPARK_DRAFT, prev)
        tokens[:, k] = prev
        drafted = k + 1
    if not greedy:
        if logits_out is None:
            logits_out = torch.zeros(
                (bs, gamma, markov.vocab_size),
                dtype=markov.step_logits_dtype(hidden.dtype),
                device=hidden.device,
            )
        proposer.noise.offset.add_(1)  # one block drawn, as SGLang's pass counts
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


def install() -> None:
    register_after(WORKER_INIT, _link_planner)
    register_around(PROPOSE, _propose)


HOOKS = {"cpu_draft_until_verifiable": install}
