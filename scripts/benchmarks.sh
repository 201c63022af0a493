#!/usr/bin/env bash
# Every table in BENCHMARKS.md: runs the stages, then writes this host's section of BENCHMARKS.md
# (scripts/write_benchmarks.py; other CPU kinds' sections are kept). Each stage's folder is kept;
# rerun one alone with STAGES="tau". Run on an idle machine: other CPU load distorts every ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$HOME/.cache/eaglespec/runs/benchmarks}
STAGES=${STAGES:-"curve ablation main int4-q8 batch tau serve"}
N=${N:-8}            # questions per dataset in the main tables
SPREAD=${SPREAD:---spread}  # N questions spaced evenly over each set (MT-bench: one per category); SPREAD= for the first N
TREE=${TREE:-auto+lookup}  # the eagle row of the main table (the CLI's default on a CPU)
TREE4=${TREE4:-auto+lookup}  # the same for the quantized targets
BATCH_TREE=${BATCH_TREE:-chain:1}  # batches need a static tree
WRITE=${WRITE:-1}    # WRITE=0: run the stages without touching BENCHMARKS.md
QWEN=${QWEN:-qwen2.5-coder-0.5b-instruct}  # the second model family's stages (qwen-*: not in the default STAGES)
QN=${QN:-4}          # questions per dataset in its tables (its vanilla decodes ~5x slower than SmolLM2's)
QN_TAU=${QN_TAU:-20} # questions per dataset for its acceptance table
mkdir -p "$OUT"
DOT=()
# FP32: the fp32 target's kernels for every fp32 stage. "auto": --packed where the profile stage
# measured it faster for one token (vanilla's step), else torch's default: a slower vanilla than
# `hf` would make every ratio a lie. Without a profile stage: --packed (the commands' own default
# where eaglespec's kernels run).
FP32=${FP32:-auto}
fp32_kernels() {
  if [ "$FP32" != auto ]; then echo "$FP32"; return; fi
  python - "$OUT/profile/cost_curve.json" "$OUT/profile-packed/cost_curve.json" <<'PY'
import json, sys
try:
    default, packed = (json.load(open(p))["verify_s"][0] for p in sys.argv[1:])
except OSError:
    print("--packed")
    sys.exit(0)
print("--packed" if packed < default else "--no-packed")
PY
}
for stage in $STAGES; do
  case $stage in
    profile)   # the machine's cost curve: fp32 (torch's default kernels), fp32 pre-packed (the default where it runs), int8, int4
      eaglespec profile --no-packed --out "$OUT/profile" | tee "$OUT/profile.md"
      eaglespec profile --packed --out "$OUT/profile-packed" | tee "$OUT/profile-packed.md"
      eaglespec profile --quantize int8 --out "$OUT/profile-int8" | tee "$OUT/profile-int8.md"
      eaglespec profile --quantize int4 --out "$OUT/profile-int4" | tee "$OUT/profile-int4.md"
      eaglespec profile --quantize bf16 --out "$OUT/profile-bf16" | tee "$OUT/profile-bf16.md"
      if [ -n "$(python -c 'from eaglespec.cpu.kernels import bf16dot_available as a; print(a() or "")')" ]; then
        for kind in bf16-dot int4-dot; do
          eaglespec profile --quantize $kind --out "$OUT/profile-$kind" | tee "$OUT/profile-$kind.md"
          DOT+=($kind="$OUT/profile-$kind/cost_curve.json")
        done
      fi
      eaglespec profile --compare fp32="$OUT/profile/cost_curve.json" packed="$OUT/profile-packed/cost_curve.json" \
        int8="$OUT/profile-int8/cost_curve.json" int4="$OUT/profile-int4/cost_curve.json" \
        bf16="$OUT/profile-bf16/cost_curve.json" "${DOT[@]}" --out "$OUT/profile-all" \
        | tee "$OUT/profile-all.md" ;;
    curve)     # the fp32 target's cost curve alone, with the kernels of the other fp32 stages (profile measures every kind)
      K=$(fp32_kernels)
      eaglespec profile $K --out "$OUT/curve" | tee "$OUT/curve.md" ;;
    ablation)  # which tree: paper vs chain vs dynamic vs auto, MT-bench first turns, T=0
      K=$(fp32_kernels)
      eaglespec bench $K --dataset mt_bench --first-turn-only --limit 6 --temperature 0 --tree paper \
        --methods vanilla,eagle,eagle-chain,eagle@chain:1,eagle@chain:2,eagle@chain:3,eagle@dynamic:4,3,8,eagle@dynamic:6,4,16,eagle@auto,eagle@auto+lookup \
        --out "$OUT/ablation" ;;
    ablation-int4)  # the same question for the int4 target, whose cost curve differs
      eaglespec bench --quantize int4 --dataset mt_bench --first-turn-only --limit 6 --temperature 0 --tree paper \
        --methods vanilla,eagle@chain:1,eagle@chain:2,eagle@chain:3,eagle@dynamic:3,3,4,eagle@auto,eagle@auto+lookup --out "$OUT/ablation-int4" ;;
    ablation-int4-dot)  # the same for int4-dot, the fastest target where the CPU has AVX512-BF16
      eaglespec bench --quantize int4-dot --dataset mt_bench --first-turn-only --limit 6 --temperature 0 --tree paper \
        --methods vanilla,eagle@chain:1,eagle@chain:2,eagle@chain:3,eagle@dynamic:3,3,4,eagle@auto,eagle@auto+lookup --out "$OUT/ablation-int4-dot" ;;
    main)      # all four datasets, T=0 and T=1, every peer
      K=$(fp32_kernels)
      eaglespec bench $K --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only --temperature 0,1 --tree "$TREE" \
        --methods vanilla,hf,pld,eagle,eagle@auto,eagle@chain:1,llamacpp,llamacpp-pld --out "$OUT/main" ;;
    compile)   # the torch.compile'd fp32 target (its own vanilla) on the ablation's questions; cold compile included once
      eaglespec bench --compile --dataset mt_bench --first-turn-only --limit 6 --temperature 0 --tree auto \
        --methods vanilla,eagle,eagle@chain:1 --out "$OUT/compile" ;;
    batch)     # paper Table 7: throughput at batch sizes 1, 2, 4
      K=$(fp32_kernels)
      eaglespec bench $K --dataset mt_bench --first-turn-only --limit 4 --temperature 0 --tree "$BATCH_TREE" \
        --methods vanilla,eagle --batch-size 1,2,4 --out "$OUT/batch" ;;
    int4)      # the fast target: weight-only int4 (its own vanilla), all four datasets, against llama.cpp
      eaglespec bench --quantize int4 --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only \
        --temperature 0,1 --tree "$TREE4" --methods vanilla,hf,pld,eagle,eagle@auto,llamacpp --out "$OUT/int4" ;;
    int4-t1)   # T = 1 on the int4 target: auto (a sampled dynamic tree) vs chain:1 (one sampled draft)
      eaglespec bench --quantize int4 --dataset mt_bench --first-turn-only --limit 6 --temperature 1 --tree auto \
        --methods vanilla,eagle,eagle@chain:1 --out "$OUT/int4-t1" ;;
    bf16)      # weight-only bf16 (its own vanilla): half fp32's bytes, fp32 arithmetic; all four datasets, T=0
      eaglespec bench --quantize bf16 --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only \
        --temperature 0 --tree "$TREE4" --methods vanilla,hf,eagle,eagle@auto,llamacpp --out "$OUT/bf16" ;;
    bf16-dot)  # bf16 weights and bf16-rounded linear inputs (AVX512-BF16; its own vanilla): cheaper trees than bf16
      eaglespec bench --quantize bf16-dot --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only \
        --temperature 0 --tree "$TREE4" --methods vanilla,hf,eagle,eagle@auto,llamacpp --out "$OUT/bf16-dot" ;;
    int4-dot)  # int4 weights and bf16-rounded linear inputs (AVX512-BF16; its own vanilla): int4's bytes, bf16-dot's trees
      eaglespec bench --quantize int4-dot --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only \
        --temperature 0,1 --tree "$TREE4" --methods vanilla,hf,eagle,eagle@auto,llamacpp --out "$OUT/int4-dot" ;;
    int4-q8)   # int4 weights and int8 inputs per 32 (AVX512-VNNI; its own vanilla): llama.cpp's Q4 x Q8 arithmetic
      eaglespec bench --quantize int4-q8 --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only \
        --temperature 0,1 --tree "$TREE4" --methods vanilla,hf,eagle,eagle@auto,eagle@chain:1,llamacpp --out "$OUT/int4-q8" ;;
    int4-dot-compile)  # the same, torch.compile'd (cold compilation included in the process, not in the numbers)
      eaglespec bench --quantize int4-dot --compile --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$N" $SPREAD --first-turn-only \
        --temperature 0 --tree "$TREE4" --methods vanilla,eagle,eagle@auto,llamacpp --out "$OUT/int4-dot-compile" ;;
    int8)      # weight-only int8 (slower than fp32 on this CPU: not in the default stages)
      eaglespec bench --quantize int8 --dataset mt_bench --first-turn-only --limit 5 --temperature 0 --tree "$TREE" \
        --methods vanilla,eagle,hf,llamacpp --out "$OUT/int8" ;;
    serve)     # the server under 1, 4, 8 concurrent clients: one request at a time vs continuous batching
      python -m eaglespec.bench.serving --out "$OUT/serve" ;;
    engines)   # the same heads in official EAGLE, vLLM and llama.cpp (prepared by scripts/engines.sh), beside eaglespec
      python -m eaglespec.bench.engines --eagle3-head "${EAGLE3_HEAD:-eagle3}" --eagle1-head "${EAGLE1_HEAD:-eagle1}" \
        --limit "$N" --out "$OUT/engines" ;;
    qwen-engines)  # its eagle3 head in vLLM and llama.cpp beside eaglespec, on HumanEval first turns
      python -m eaglespec.bench.engines --model "$QWEN" --dataset humaneval --engines eaglespec,vllm,llama.cpp \
        --eagle3-head "${QWEN_EAGLE3_HEAD:-eagle3}" --limit "$N" --out "$OUT/qwen-engines" ;;
    qwen-curve)  # the second model family (Qwen2.5-Coder-0.5B): its fp32 cost curve
      eaglespec profile --model "$QWEN" --out "$OUT/qwen-curve" | tee "$OUT/qwen-curve.md" ;;
    qwen-main)   # its shipped head on the four sets, T=0 and T=1, against its own vanilla, hf, pld and llama.cpp
      eaglespec bench --model "$QWEN" --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$QN" $SPREAD --first-turn-only \
        --temperature 0,1 --tree "$TREE" --methods vanilla,hf,pld,eagle,eagle@chain:2,llamacpp --out "$OUT/qwen-main" ;;
    qwen-int4-q8)  # the fastest quantized Qwen target (its own vanilla), against llama.cpp's plain decoding of the GGUF
      eaglespec bench --model "$QWEN" --quantize fastest --dataset mt_bench,humaneval,gsm8k,alpaca --limit "$QN" $SPREAD \
        --first-turn-only --temperature 0,1 --tree "$TREE4" --methods vanilla,eagle,eagle@chain:2,llamacpp \
        --out "$OUT/qwen-int4-q8" ;;
    qwen-tau)    # its head's acceptance on the paper tree (tau, n-alpha): HumanEval and MT-bench first turns, T=0
      eaglespec bench --model "$QWEN" --dataset humaneval,mt_bench --limit "$QN_TAU" $SPREAD --first-turn-only \
        --temperature 0 --tree paper --methods eagle --out "$OUT/qwen-tau" ;;
    tau)       # the model card's acceptance: 80 MT-bench first turns, paper tree, T=0
      K=$(fp32_kernels)
      eaglespec bench $K --dataset mt_bench --first-turn-only --temperature 0 --tree paper \
        --methods eagle --out "$OUT/tau80" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
if [ "$WRITE" = 1 ]; then
  python scripts/write_benchmarks.py "$OUT"
fi
