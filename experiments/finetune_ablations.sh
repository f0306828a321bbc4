#!/usr/bin/env bash
# Paired ablations in the fine-tune regime: every arm fine-tunes the shipped drafter with one
# change, everything else equal; then one `sglang-dspark compare` of all arms.
#
#   experiments/finetune_ablations.sh OUT_DIR       (about 2 h 30 min on 2 idle cores)
#
# Data: the same 192 prompts (48 per domain: code, chat, math, writing; `data build --seed 2`,
# the packaged eval prompts kept out) answered by the target twice, greedily and sampled at
# T=0.7 (DeepSpec's choice). Every arm: 150 steps from the shipped drafter, seed 0, lr 3e-4,
# 2 688 LM-head positions per step (8 sequences x 48 anchors x 7), position-weight decay 1.5
# (the shipped drafter's last stages), greedy responses, except for its one change:
#   greedy    the reference arm
#   t07       responses sampled at T=0.7
#   decay4    decay 4 (DeepSpec's)
#   decay7    decay 7 = gamma (the paper's text)
#   anchors24 24 anchors per sequence, 16 sequences per step (same positions per step)
# Then `sglang-dspark compare` on the packaged eval prompts at T=1 (same prompts and per-prompt
# seeds; the shipped DSpark and MTP-1 drafters beside the arms). Fine-tuning the shipped drafter
# rather than training from scratch keeps the arms where later draft positions are reached.
# Resumable: rerun the same command (finished data and runs are kept).
set -euxo pipefail
OUT=${1:?usage: experiments/finetune_ablations.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$REPO/.venv/bin}
ASSETS=$REPO/sglang_dspark/assets
T=$("$BIN/sglang-dspark" setup-smollm2)
export THP_MEM_ALLOC_ENABLE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for t in 0 0.7; do
  "$BIN/sglang-dspark" data build --out "$OUT/data-t$t" --target "$T" --backend hf \
      --batch-size 32 --dtype bfloat16 --domains code,chat,math,writing --per-domain 48 \
      --max-new-tokens 256 --seed 2 --temperature $t --no-progress
  mkdir -p "$OUT/train-t$t"
  for f in "$OUT/data-t$t"/*.jsonl; do cp "$f" "$OUT/train-t$t/regen-$(basename "$f")"; done
done
# arm | training data | its one change
ARMS=(
  "greedy|train-t0|"
  "t07|train-t0.7|"
  "decay4|train-t0|--decay 4"
  "decay7|train-t0|--decay 7"
  "anchors24|train-t0|--num-anchors 24 --global-batch-size 16"
)
DRAFTS=(--draft shipped="$ASSETS/smollm2-dspark" --draft mtp1="$ASSETS/smollm2-mtp1")
for arm in "${ARMS[@]}"; do
  IFS='|' read -r name data change <<<"$arm"
  DRAFTS+=(--draft "$name=$OUT/run-$name/draft")
  test -f "$OUT/run-$name/draft/config.json" && continue
  # shellcheck disable=SC2086  # $change is a list of flags
  "$BIN/sglang-dspark" train --config "$REPO/configs/smollm2-dspark.json" --data "$OUT/$data" \
      --target "$T" --out-dir "$OUT/run-$name" --init-draft "$ASSETS/smollm2-dspark" --steps 150 \
      --lr 3e-4 --warmup-ratio 0.02 --checkpoint-every 25 --decay 1.5 --seed 0 --no-progress $change
done
"$BIN/sglang-dspark" compare --target "$T" "${DRAFTS[@]}" --out "$OUT/compare" \
    --limit 10 --max-new-tokens 128 --temperatures 1 --no-progress
