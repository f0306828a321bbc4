"""Eval folders of training prompts the shipped drafter saw and same-domain prompts it did not.

    python experiments/seen_unseen_prompts.py --out EVDIR [--per-domain 5]
    sglang-dspark evaluate --target $T --draft sglang_dspark/assets/smollm2-dspark --out EVAL \
        --eval-dir EVDIR --benchmarks seen-code,unseen-code,seen-chat,unseen-chat,seen-math,\
unseen-math,gsm8k,humaneval,mt-bench --limit 5 --temperatures 0,1 --max-new-tokens 128

Seen: the first prompts of the shipped drafter's training build (`data prompts --seed 0
--per-domain 400`, code, chat, math; its recipe answered all of them). Unseen: prompts of
`--seed 5` whose source (the id without its template suffix) and text are in neither the
seed-0 build nor its `writing` build. The packaged eval prompts are copied beside them, so one
`evaluate` run puts memorisation (seen against unseen) next to domain shift (unseen against
the benchmarks).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from sglang_dspark.data.eval_guard import EvalGuard, prompt_text
from sglang_dspark.data.prompts import build_prompts
from sglang_dspark.evaluation.benchmarks import PACKAGED_EVAL_DIR

DOMAINS = ("code", "chat", "math")


def _source(prompt: dict) -> str:
    return prompt["id"].rsplit("/", 1)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--per-domain", type=int, default=5)
    args = ap.parse_args()
    guard = EvalGuard.from_dir(PACKAGED_EVAL_DIR)
    seen = build_prompts(400, 0, DOMAINS, guard).by_domain
    writing = build_prompts(640, 0, ("writing",), guard).by_domain["writing"]
    trained = [p for ps in seen.values() for p in ps] + writing
    sources, texts = {_source(p) for p in trained}, {prompt_text(p) for p in trained}
    candidates = build_prompts(200, 5, DOMAINS, guard).by_domain
    args.out.mkdir(parents=True, exist_ok=True)
    for domain in DOMAINS:
        unseen = [
            p
            for p in candidates[domain]
            if _source(p) not in sources and prompt_text(p) not in texts
        ]
        for name, prompts in (("seen", seen[domain]), ("unseen", unseen)):
            with open(args.out / f"{name}-{domain}.jsonl", "w") as fh:
                fh.writelines(
                    json.dumps({"turns": [prompt_text(p)], "id": p["id"]}) + "\n"
                    for p in prompts[: args.per_domain]
                )
    for path in PACKAGED_EVAL_DIR.glob("*.jsonl"):
        shutil.copy(path, args.out / path.name)
    print(args.out)


if __name__ == "__main__":
    main()
