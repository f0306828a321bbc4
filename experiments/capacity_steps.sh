#!/usr/bin/env bash
# What limits the shipped drafter: optimizer steps or capacity? One paired run, two arms from
# the shipped drafter on the same data, steps, schedule and seed, each with a held-out
# learning curve (train --eval-data: per draft position, the mean of 1 - TV/2 against the
# target on responses the target sampled at T=1 to prompts no arm trains on, i.e. the expected
# acceptance at temperature 1; at step 0 and every 50 steps):
#   cont     the shipped drafter (1 layer) trained on        -> is it still gaining with steps?
#   grow     plus a second layer (--grow-layers 1)            -> does a layer add to the steps?
#   rank256  its Markov head at rank 256 instead of 64 (--grow-markov-rank 256)
#                                                             -> does the Markov head's rank?
# (both grown drafters start as exactly the shipped drafter's function).
#
#   experiments/capacity_steps.sh OUT_DIR [STEPS]      (STEPS 500: about 2 h on 2 idle cores)
#
# Data: 320 new prompts (80 per domain: code, chat, math, writing; `data build --seed 2`)
# answered greedily by the target, plus the 661 prompt-text sequences; held out: 64 prompts
# of `data build --seed 3` answered at T=1, those sharing a prompt with the training data
# dropped. cont and grow run at once, one thread each, then rank256 on two; one feature store.
# Then `sglang-dspark curves` draws the curves. Resumable: rerun the same command.
set -euxo pipefail
OUT=${1:?usage: experiments/capacity_steps.sh OUT_DIR [STEPS]}
STEPS=${2:-500}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$REPO/.venv/bin}
T=$("$BIN/sglang-dspark" setup-smollm2)
export THP_MEM_ALLOC_ENABLE=1 OMP_NUM_THREADS=2
build() {  # OUT_SUBDIR SEED PER_DOMAIN TEMPERATURE
  "$BIN/sglang-dspark" data build --out "$OUT/$1" --target "$T" --backend hf --batch-size 32 \
      --dtype bfloat16 --domains code,chat,math,writing --per-domain "$3" --max-new-tokens 256 \
      --seed "$2" --temperature "$4" --no-progress
}
build heldout-t1 3 16 1
build train-t0 2 80 0
test -f "$OUT/prompts.jsonl" || "$BIN/python" "$REPO/recipes/prompt_sequences.py" --target "$T" \
    --out "$OUT/prompts.jsonl" --per-domain 400 --seed 1
mkdir -p "$OUT/train" "$OUT/heldout"
cp "$OUT/prompts.jsonl" "$OUT/train/prompts.jsonl"
for f in "$OUT"/train-t0/*.jsonl; do cp "$f" "$OUT/train/regen-$(basename "$f")"; done
"$BIN/python" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def prompt(rec):  # the tokens before the first supervised one
    mask = rec["loss_mask"]
    return tuple(rec["input_ids"][: mask.index(1) if 1 in mask else len(mask)])
seen = {prompt(json.loads(line)) for f in (out / "train").glob("*.jsonl")
        for line in f.read_text().splitlines() if line.strip()}
kept = dropped = 0
with open(out / "heldout" / "heldout-t1.jsonl", "w") as fh:
    for f in sorted((out / "heldout-t1").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip() and prompt(json.loads(line)) not in seen:
                fh.write(line + "\n"); kept += 1
            elif line.strip():
                dropped += 1
print(f"held out: {kept} sequences kept, {dropped} sharing a prompt with the training data dropped")
PY
train() {  # NAME THREADS [FLAGS...]
  local name=$1 threads=$2; shift 2
  test -f "$OUT/run-$name/draft/config.json" && return 0
  OMP_NUM_THREADS=$threads "$BIN/sglang-dspark" train --config "$REPO/configs/smollm2-dspark.json" \
      --data "$OUT/train" --target "$T" --out-dir "$OUT/run-$name" \
      --init-draft "$REPO/sglang_dspark/assets/smollm2-dspark" --steps "$STEPS" --lr 3e-4 \
      --warmup-ratio 0.02 --checkpoint-every 50 --decay 1.5 --seed 0 --eval-data "$OUT/heldout" \
      --eval-every 50 --feature-store "$OUT/features" --no-progress "$@" > "$OUT/run-$name.log" 2>&1
}
train cont 1 & a=$!; train grow 1 --grow-layers 1 & b=$!; wait "$a"; wait "$b"
train rank256 2 --grow-markov-rank 256
"$BIN/sglang-dspark" curves cont="$OUT/run-cont" grow="$OUT/run-grow" rank256="$OUT/run-rank256" \
    --out "$OUT/curves"
