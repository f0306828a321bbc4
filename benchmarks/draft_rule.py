#!/usr/bin/env python3
"""Why MTP-1's accept length in the server is below its offline one: the drafting rule.

    python benchmarks/draft_rule.py [--data recipes/data/smollm2-heldout-t1]

The offline figure (the trainers' held-out `evaluate`, `sglang-dspark compare`) is the
acceptance of a draft SAMPLED from the drafter's distribution q and verified by rejection
sampling: E[accept] = sum_x min(p(x), q(x)) = 1 - TV(p, q). DSPARK serves exactly that
(the Markov step samples at the request's temperature; the verifier gets q). SGLang's EAGLE
worker, which serves the MTP-1 baseline, drafts the ARGMAX of q (top-k = 1) and verifies it
target-only (a one-hot proposal): E[accept] = p(argmax q). At T=1 the two differ whenever the
target spreads its mass.

For both shipped drafters, on the held-out T=1 samples and the same teacher-forced positions:
a_k under each rule, and the accept length each implies. Prints one table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def argmax_rule(draft_logits, target, labels):
    """`loss.tv_ce`'s signature; its "TV" is 2 (1 - p(argmax q)), so 1 - TV/2 = p(argmax q)."""
    import torch

    vocab = draft_logits.shape[-1]
    z = draft_logits.reshape(-1, vocab)
    p = torch.softmax(target.reshape(-1, vocab).float(), -1)
    accept = p.gather(1, z.argmax(-1, keepdim=True))[:, 0]
    lead = draft_logits.shape[:-1]
    return (2.0 * (1.0 - accept)).view(lead), torch.zeros_like(accept).view(lead)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--data", default=str(ROOT / "recipes/data/smollm2-heldout-t1"))
    args = parser.parse_args(argv)

    from sglang_dspark.drafter.training import held_out, loss
    from sglang_dspark.drafter.training.config import TrainConfig
    from sglang_dspark.drafter.training.registry import build_trainer
    from sglang_dspark.serving.smollm2 import ensure_smollm2

    target = str(ensure_smollm2(dtype="bfloat16"))
    arms = {"DSpark": ("smollm2-dspark", "dspark"), "MTP-1": ("smollm2-mtp1", "mtp")}
    rows = []
    for name, (asset, kind) in arms.items():
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig.from_json(
                ROOT / f"configs/{asset}.json", target=target, out_dir=out, drafter=kind,
                init_draft=str(ROOT / "sglang_dspark/assets" / asset), eval_data=args.data,
                data=args.data,
            )  # fmt: skip
            trainer = build_trainer(cfg)
            sampled = trainer.evaluate()
            saved = loss.tv_ce, held_out.tv_ce
            loss.tv_ce = held_out.tv_ce = argmax_rule
            try:
                greedy = trainer.evaluate()
            finally:
                loss.tv_ce, held_out.tv_ce = saved
        rows.append((name, "sampled draft, rejection sampling (1 - TV)", sampled))
        rows.append((name, "argmax draft, target-only verify (p(argmax q))", greedy))
    print(f"held-out {args.data}, T=1, teacher-forced")
    print("| drafter | rule | a_1 | a_2..a_7 | accept length |")
    print("| --- | --- | --- | --- | --- |")
    for name, rule, rec in rows:
        a = rec["accept"]
        rest = " ".join(f"{x:.3f}" for x in a[1:]) or "-"
        print(f"| {name} | {rule} | {a[0]:.3f} | {rest} | {rec['tau_estimate']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
