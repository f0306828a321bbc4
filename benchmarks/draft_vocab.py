#!/usr/bin/env python3
"""What a reduced draft vocabulary costs in acceptance, offline, on held-out T=1 samples.

    python benchmarks/draft_vocab.py --sizes 8192,16384,32768 [--draft DIR] [--data DIR]

For each size N: the N most frequent response tokens of the training data
(`recipes/data/smollm2-regen-t07`, `sglang-dspark draft-vocab`), then the drafter's held-out
acceptance per draft position (teacher-forced 1 - TV/2 against the exact target distribution at
T=1, the trainer's `evaluate` on `recipes/data/smollm2-heldout-t1`) with its logits outside the
subset at -inf, beside the full vocabulary on the same blocks. Prints the table (a_1..a_gamma,
the accept length they imply, the subset's share of the training tokens). The milliseconds the
subset saves are measured in the server (`benchmarks/profile_round.py`, arms `dspark-vocabN`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--draft", default=str(ROOT / "sglang_dspark/assets/smollm2-dspark"))
    parser.add_argument("--config", default=str(ROOT / "configs/smollm2-dspark.json"))
    parser.add_argument("--train-data", default=str(ROOT / "recipes/data/smollm2-regen-t07"))
    parser.add_argument("--data", default=str(ROOT / "recipes/data/smollm2-heldout-t1"))
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from sglang_dspark.drafter.formats import draft_vocab
    from sglang_dspark.drafter.training.config import TrainConfig
    from sglang_dspark.drafter.training.data import load_sequences
    from sglang_dspark.drafter.training.registry import build_trainer
    from sglang_dspark.serving.smollm2 import ensure_smollm2

    target = str(ensure_smollm2(dtype="bfloat16"))
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig.from_json(
            args.config, target=target, out_dir=out, init_draft=args.draft, eval_data=args.data,
            data=args.train_data,
        )  # fmt: skip
        trainer = build_trainer(cfg)
        vocab = int(AutoConfig.from_pretrained(target).vocab_size)
        tok = AutoTokenizer.from_pretrained(target)
        full_logits = trainer.drafter.draft_logits
        rows = [("full", None, 1.0, trainer.evaluate())]
        seqs = load_sequences(args.train_data, max_length=cfg.max_length)
        counts = None
        for size in [int(s) for s in args.sizes.split(",")]:
            if counts is None:
                counts = draft_vocab.token_counts(seqs, vocab)
            always = [t for t in tok.all_special_ids if t < counts.numel()]
            ids = draft_vocab.top_tokens(counts, size, always)
            outside = torch.ones(counts.numel(), dtype=torch.bool)
            outside[ids] = False

            def restricted(hidden, prev, _outside=outside):
                logits = full_logits(hidden, prev)
                return logits.masked_fill(_outside.to(logits.device), float("-inf"))

            trainer.drafter.draft_logits = restricted
            rows.append((str(size), ids, draft_vocab.coverage(counts, ids), trainer.evaluate()))
        trainer.drafter.draft_logits = full_logits
    gamma = len(rows[0][3]["accept"])
    print(f"held-out {args.data}: {rows[0][3]['positions'][0]} positions at draft position 1")
    head = " | ".join(f"a_{k + 1}" for k in range(gamma))
    print(f"| vocabulary | train-token share | {head} | accept length | vs full |")
    print("| --- " * (gamma + 4) + "|")
    base = rows[0][3]["tau_estimate"]
    for name, _, share, rec in rows:
        a = " | ".join(f"{x:.4f}" for x in rec["accept"])
        tau = rec["tau_estimate"]
        print(f"| {name} | {share:.2%} | {a} | {tau:.4f} | {tau / base - 1:+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
