#!/usr/bin/env python3
"""Would drafting at another temperature than the request's raise acceptance at T=1?

    python experiments/draft_temperature_scan.py [--draft DIR] [--limit 6] [--max-new-tokens 96]

Verification stays exact for any proposal distribution the verifier knows, so a server could
sample the draft from softmax(logits / (s T)) and verify against that. This runs the offline
evaluator at T=1 (float32, the packaged gsm8k / humaneval / mt-bench prompts) and, on every
round, computes the first draft's acceptance probability sum_x min(p_T(x), q_{sT}(x)) for each
scale s on the same round (paired; later positions depend on the sampled draft and are left
out). Prints the mean per scale and its difference to s = 1 with a 95% interval.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

SCALES = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from sglang_dspark.evaluation import decoding, runner
    from sglang_dspark.evaluation.benchmarks import default_eval_dir, load_prompts
    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.client import chat_prompt_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None, help="draft dir (default: the shipped drafter)")
    parser.add_argument("--limit", type=int, default=6, help="prompts per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    paths = embedded.ensure(dtype="bfloat16")
    acc: dict[float, list[float]] = {s: [] for s in SCALES}

    def recording_verify(drafts, target_logits, draft_logits, temperature, generator):
        if temperature > 0:
            p = torch.softmax(target_logits[0].float() / temperature, -1)
            for s in SCALES:
                q = torch.softmax(draft_logits[0].float() / (temperature * s), -1)
                acc[s].append(torch.minimum(p, q).sum().item())
        return decoding.verify_block(drafts, target_logits, draft_logits, temperature, generator)

    runner.speculative_generate = functools.partial(
        decoding.speculative_generate, verify=recording_verify
    )
    tok = AutoTokenizer.from_pretrained(paths.target)
    prompts = {
        b: [chat_prompt_ids(tok, t) for t in load_prompts(default_eval_dir(), b, args.limit)]
        for b in ("gsm8k", "humaneval", "mt-bench")
    }
    target, proposer = runner.load_models(paths.target, args.draft or paths.draft)
    runner.evaluate(target, proposer, prompts, temperatures=[1.0],
                    max_new_tokens=args.max_new_tokens, seed=0)  # fmt: skip
    base = torch.tensor(acc[1.0])
    n = len(base)
    for s in SCALES:
        a = torch.tensor(acc[s])
        d = a - base
        print(f"scale {s:.1f}: first-draft acceptance {a.mean():.4f}, vs 1.0 {d.mean():+.4f} "
              f"+- {1.96 * d.std() / n**0.5:.4f} ({n} rounds)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
