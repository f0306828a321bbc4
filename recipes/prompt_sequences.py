#!/usr/bin/env python3
"""Extra drafter training sequences from the training prompts themselves (no generation).

Each prompt is chat-templated and written as {"input_ids", "loss_mask"} with loss_mask 1 on the
user's text: the drafter then learns the target's own next-token distribution (TV to p_t) over
code, docs and math text. Regenerated responses (`sglang-dspark data build`) match serving
better but cost target decoding, which on 2 CPU cores is slow; this complements them.

    python recipes/prompt_sequences.py --target DIR --out prompts.jsonl --per-domain 600 --seed 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--per-domain", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-tokens", type=int, default=48)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from sglang_dspark.data.eval_guard import EvalGuard
    from sglang_dspark.data.prompts import build_prompts

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = build_prompts(args.per_domain, args.seed, guard=EvalGuard.from_dir())
    n = 0
    with args.out.open("w") as f:
        for domain, items in prompts.by_domain.items():
            for p in items:
                ids = tok.apply_chat_template(
                    p["messages"], add_generation_prompt=False, tokenize=True, return_dict=False
                )
                text_ids = tok(p["messages"][0]["content"], add_special_tokens=False)["input_ids"]
                if len(text_ids) < args.min_tokens:
                    continue
                # loss on the user's text: find it inside the templated ids
                start = next((i for i in range(len(ids)) if ids[i : i + 8] == text_ids[:8]), None)
                if start is None:
                    continue
                mask = [0] * len(ids)
                for i in range(start, min(start + len(text_ids), len(ids))):
                    mask[i] = 1
                f.write(json.dumps({"id": "p/" + p["id"], "domain": domain,
                                    "input_ids": ids, "loss_mask": mask}) + "\n")  # fmt: skip
                n += 1
    print(f"wrote {n} sequences to {args.out}")


if __name__ == "__main__":
    main()
