#!/usr/bin/env bash
# The paper's ablations on this machine, written to REPRODUCTION.md beside the paper's numbers:
#   input modes (Fig. 8), fixed vs target-generated data (Table 6), feature noise, tree vs chain
#   (Table 5), batch sizes (Table 7); and the head architectures (EAGLE-1's, EAGLE-3's, the hybrid
#   with fused layers) on the same data and budget.
#
#   scripts/reproduce.sh [--quick]
#
# One budget for every head: the same ShareGPT prompts, answers of the same lengths, the same steps,
# seed and head size (one decoder layer, EAGLE-1's inputs, an 8,192-token draft vocabulary). Stages
# (STAGES="data train eval tree batch report") resume: finished data and training runs are kept in
# $OUT. The data and training stages may share the machine; eval, tree and batch time decoding, so
# run them on an idle machine.
#
# Stage arch-qwen (not in the default list) repeats the architecture comparison at a larger budget on
# Qwen2.5-Coder-0.5B: EAGLE-3's head against the fused hybrid, both with the same 3-step
# training-time test, steps and data: the target's own answers (`regenerate --topic code` and
# `--topic other`, with `--aux-layers 2,12,21`) in $QFEATS.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
if [ "$QUICK" = 1 ]; then  # a smoke run of every stage (~10 minutes); its report stays in $OUT
  OUT=${OUT:-$HOME/.cache/eaglespec/runs/reproduce-quick}
  REPORT=${REPORT:-$OUT/REPRODUCTION.md}
  CONVS=${CONVS:-200}; NEW=${NEW:-128}; EPOCHS=${EPOCHS:-1}; LIMIT=${LIMIT:-3}; BLIMIT=${BLIMIT:-4}
else
  OUT=${OUT:-$HOME/.cache/eaglespec/runs/reproduce}
  CONVS=${CONVS:-1000}; NEW=${NEW:-160}; EPOCHS=${EPOCHS:-2}; LIMIT=${LIMIT:-8}; BLIMIT=${BLIMIT:-4}
fi
REPORT=${REPORT:-REPRODUCTION.md}
STAGES=${STAGES:-"data train eval tree batch report"}
MODEL=smollm2-135m-instruct
QWEN=qwen2.5-coder-0.5b-instruct
QFEATS=${QFEATS:-$HOME/.cache/eaglespec/features/qwen-code,$HOME/.cache/eaglespec/features/qwen-other}
QSTEPS=${QSTEPS:-250}; QLIMIT=${QLIMIT:-10}
TRAIN=(--epochs "$EPOCHS" --batch-tokens 2048 --lr 5e-4 --draft-vocab 8192 --seed 0 --save-every 100
       --eval-conversations 16 --eval-steps 3)
AUX=2,15,27  # EAGLE-3's low, mid and high layers of SmolLM2's 30
# name: input mode, data folder, noise, architecture, fused layers
RUNS="eagle:feature+shifted_token:target:0.1:hybrid: unshifted:feature+unshifted_token:target:0.1:hybrid:
      feature:feature:target:0.1:hybrid: token:token:target:0.1:hybrid: fixed:feature+shifted_token:fixed:0.1:hybrid:
      no-noise:feature+shifted_token:target:0:hybrid: eagle1:feature+shifted_token:target:0.1:eagle1:
      eagle3:feature+shifted_token:target:0.1:eagle3:$AUX hybrid-fused:feature+shifted_token:target:0.1:hybrid:$AUX"
mkdir -p "$OUT"
echo "reproduce: $OUT (conversations $CONVS, answers <= $NEW tokens, $EPOCHS epochs)" >&2
for stage in $STAGES; do
  case $stage in
    data)   # the target's answers (features written while decoding), then ShareGPT's answers to the same prompts cut to the same lengths
      eaglespec regenerate --model $MODEL --out "$OUT/data/target.jsonl" --features-out "$OUT/data/target" \
        --max-conversations "$CONVS" --max-new-tokens "$NEW" --heldout-every 16
      python scripts/reproduce.py fixed-data "$OUT/data/target.jsonl" "$OUT/data/fixed.jsonl" --heldout-every 16
      eaglespec extract --model $MODEL --data "$OUT/data/fixed.jsonl" --out "$OUT/data/fixed" --heldout 0 \
        --max-tokens 100000000
      # one held-out set for every run: the target's own answers, what a head meets when drafting
      if [ ! -L "$OUT/data/fixed/heldout" ]; then
        rm -rf "$OUT/data/fixed/heldout" && ln -s ../target/heldout "$OUT/data/fixed/heldout"
      fi
      # the fused heads' aux layers, from the same tokens
      eaglespec extract --model $MODEL --out "$OUT/data/target" --aux-layers $AUX --aux-only ;;
    train)
      for run in $RUNS; do
        IFS=: read -r name mode data noise arch aux <<< "$run"
        if [ -f "$OUT/runs/$name/head/config.json" ]; then continue; fi
        eaglespec train --features "$OUT/data/$data" --out "$OUT/runs/$name" --input-mode "$mode" --noise "$noise" \
          --arch "$arch" --aux-layers "$aux" "${TRAIN[@]}"
      done ;;
    eval)   # each head on MT-bench first turns, T = 0: the paper's tree and a chain, with their speedups
      for run in $RUNS; do
        IFS=: read -r name _ <<< "$run"
        if [ -f "$OUT/eval/$name/results.json" ]; then continue; fi
        eaglespec bench --head "$OUT/runs/$name/head" --dataset mt_bench --first-turn-only --limit "$LIMIT" --spread \
          --temperature 0 --tree paper --chain chain:4 --methods vanilla,eagle,eagle-chain --out "$OUT/eval/$name"
      done ;;
    tree)   # Table 5 with the shipped hybrid head: the paper's tree against a chain, T = 0 and 1
      eaglespec bench --head hybrid --dataset mt_bench --first-turn-only --limit "$LIMIT" --spread --temperature 0,1 --tree paper \
        --chain chain:4 --methods vanilla,eagle,eagle-chain --out "$OUT/tree" ;;
    batch)  # Table 7 with the shipped hybrid head: batch sizes 1, 2, 4 (the paper's tree, and one draft a round)
      eaglespec bench --head hybrid --dataset mt_bench --first-turn-only --limit "$BLIMIT" --temperature 0 --tree paper \
        --methods vanilla,eagle --batch-size 1,2,4 --out "$OUT/batch-paper"
      eaglespec bench --head hybrid --dataset mt_bench --first-turn-only --limit "$BLIMIT" --temperature 0 --tree chain:1 \
        --methods vanilla,eagle --batch-size 1,2,4 --out "$OUT/batch-chain1" ;;
    arch-qwen)  # each head trained (resumable), then held-out agreement on each folder's held-out split, then tau
      for arch in eagle3 hybrid; do
        if [ ! -f "$OUT/qwen-arch/$arch/head/config.json" ]; then
          eaglespec train --model $QWEN --features "$QFEATS" --out "$OUT/qwen-arch/$arch" --arch $arch --unroll 3 \
            --aux-layers 2,12,21 --draft-vocab 16384 --epochs 1 --max-steps "$QSTEPS" --lr 6e-4 --warmup-steps 30 \
            --batch-tokens 4096 --seed 0 --save-every 25 --eval-conversations 16 --eval-steps 5
        fi
      done
      python scripts/reproduce.py heldout --model $QWEN --features "$QFEATS" --aux-layers 2,12,21 \
        --out "$OUT/qwen-arch/heldout.json" "$OUT/qwen-arch/eagle3/head" "$OUT/qwen-arch/hybrid/head"
      for arch in eagle3 hybrid; do
        eaglespec bench --model $QWEN --head "$OUT/qwen-arch/$arch/head" --dataset humaneval,mt_bench --limit "$QLIMIT" \
          --spread --first-turn-only --temperature 0 --tree paper --methods eagle --out "$OUT/qwen-arch/eval-$arch"
      done ;;
    report)
      python scripts/reproduce.py report "$OUT" "$REPORT" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
