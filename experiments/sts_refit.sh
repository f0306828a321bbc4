#!/usr/bin/env bash
# STS refit on temperature-1 blocks (the headline serving temperature), with its held-out report.
#
#   experiments/sts_refit.sh OUT_DIR        (about 20 min on 2 idle cores)
#   DRAFT=DIR DATA=recipes/data/smollm2-regen-t07 experiments/sts_refit.sh OUT_DIR
#       (a new drafter, with its draft_vocab/ as served; the prompt ids of the data it was
#       trained on left out too)
#
# Fit: 128 training-style prompts the drafter never trained on (`data prompts --seed 7`, the
# drafter's training prompt ids left out), 64 new tokens each, sampled at T=1 by the embedded
# DSPARK server with every draft verified (recipes/collect_sts.py). Held out, never fitted:
#   held-train  the next 64 unseen training-style prompts (T=1)
#   held-eval   the packaged eval prompts, 20 per benchmark (T=1)
#   held-eval-t0, held-train-t0: the same held-out prompts greedy (T=0)
# Each held-out set is scored for the new fit and for the shipped sts.json (--baseline) on the
# same blocks. Writes OUT_DIR/sts-t1.json, its metrics per held-out set and reliability plots.
set -euo pipefail
OUT=${1:?usage: experiments/sts_refit.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$REPO/.venv/bin}
SHIPPED=$REPO/sglang_dspark/assets/smollm2-dspark/sts.json
DRAFT=${DRAFT:-}  # a drafter directory to calibrate (default: the embedded one)
DATA=${DATA:-}    # training data directories whose prompt ids are left out too (space-separated)
# Blocks must come from the drafter as it is served: the embedded one drafts from its 16k
# draft vocabulary (draft_vocab/), and a DRAFT without it would calibrate full-vocabulary drafts.
if [[ -n $DRAFT && ! -f $DRAFT/draft_vocab/vocab.safetensors && -z ${FULL_VOCAB:-} ]]; then
    echo "DRAFT=$DRAFT has no draft_vocab/vocab.safetensors, so its blocks would be drafted from" \
        "the full vocabulary, not as the embedded server drafts: copy" \
        "sglang_dspark/assets/smollm2-dspark/draft_vocab into it (or set FULL_VOCAB=1 to" \
        "calibrate full-vocabulary drafting)" >&2
    exit 2
fi
mkdir -p "$OUT"

# The drafter's training prompts (assets/smollm2-dspark/README.md), for their ids only.
"$BIN/sglang-dspark" data prompts --out "$OUT/train-a.jsonl" --per-domain 400 --seed 0
"$BIN/sglang-dspark" data prompts --out "$OUT/train-w.jsonl" --per-domain 640 --seed 0 --domains writing
"$BIN/sglang-dspark" data prompts --out "$OUT/train-b.jsonl" --per-domain 400 --seed 1
SKIP=("$OUT/train-a.jsonl" "$OUT/train-w.jsonl" "$OUT/train-b.jsonl")
for d in $DATA; do SKIP+=("$d"/*.jsonl*); done

# 150 candidates per domain; collect_sts.py keeps the first unseen ones, in file order.
"$BIN/sglang-dspark" data prompts --out "$OUT/pool.jsonl" --per-domain 150 --seed 7 \
    --domains code,chat,math,writing
"$BIN/python" - "$OUT" "${SKIP[@]}" <<'EOF'
import gzip, json, sys
from pathlib import Path
out, skip_files = Path(sys.argv[1]), sys.argv[2:]
skip = set()
for f in skip_files:
    opener = gzip.open if f.endswith(".gz") else open
    for line in opener(f, "rt").read().splitlines():
        if line.strip():
            i = json.loads(line)["id"]
            skip |= {i, "p/" + i}
rows = [json.loads(l) for l in (out / "pool.jsonl").read_text().splitlines() if l.strip()]
rows = [r for r in rows if r["id"] not in skip and r["id"].removeprefix("p/") not in skip]
assert len(rows) >= 192, f"only {len(rows)} unseen prompts in the pool"
for name, part in (("fit", rows[:128]), ("held", rows[128:192])):
    (out / f"prompts-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
print(f"{len(rows)} unseen prompts: 128 to fit, 64 held out")
EOF

collect() {  # collect STEM TEMPERATURE ARGS...
    local stem=$1 t=$2; shift 2
    "$BIN/python" "$REPO/recipes/collect_sts.py" "$@" ${DRAFT:+--draft "$DRAFT"} \
        --temperature "$t" --max-new-tokens 64 \
        --out-stem "$OUT/$stem"
}
collect fit 1 --prompts "$OUT/prompts-fit.jsonl" --limit 128
collect held-train 1 --prompts "$OUT/prompts-held.jsonl" --limit 64
collect held-eval 1 --benchmarks gsm8k,humaneval,mt-bench --limit 20
collect held-train-t0 0 --prompts "$OUT/prompts-held.jsonl" --limit 64
collect held-eval-t0 0 --benchmarks gsm8k,humaneval,mt-bench --limit 20

for held in held-train held-eval held-train-t0 held-eval-t0; do
    "$BIN/sglang-dspark" calibrate --data "$OUT/fit.rank*.pt" --heldout-data "$OUT/$held.rank*.pt" \
        --gamma 7 --baseline "$SHIPPED" --out "$OUT/sts-t1.json" \
        --metrics "$OUT/metrics-$held.json" --plot "$OUT/reliability-$held.png"
done
echo "fit: $OUT/sts-t1.json; held-out metrics: $OUT/metrics-*.json"
