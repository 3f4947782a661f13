#!/usr/bin/env bash
# What only a GPU machine can confirm, as one command from the repository root (moeify importable), on
# random LLaMA-shaped bfloat16 models built from a seed (benchmarks/gpu_speed.py build: no download):
# - speed against the dense model, eager and compiled (`moeify bench`, both models in one process): CMoE
#   S1A1E8 of a LLaMA-2-7B shape; ToMoE and DSMoE at APR 0.5, a few training steps each, of a TinyLlama-1.1B
#   shape; MoRE's whole conversion time of the 7B shape;
# - `moeify plan`'s peak against the measured device peak of each conversion (record.json's memory block);
# - with MODEL set (a real checkpoint): bfloat16 perplexity within 1 % of float32 for cmoe, more, static_prune;
# - with two or more GPUs: data-parallel training over NCCL (replicated, and sharded with --fsdp) ending at
#   the one-process weights.
# One JSON file sums it up ($RESULT: every line with its value, target and whether it holds); the folders and
# logs stay in $OUT. Each step has its own timeout; a step that fails is reported and the others still run.
#
#   bash benchmarks/gpu_check.sh                                   # on the GPU machine
#   PARTS="cmoe tomoe" bash benchmarks/gpu_check.sh                # some of the conversions only
#   DEVICE=cpu LARGE=tiny SMALL=tiny TRAIN_STEPS=2 BENCH_ARGS="--prefill 2x32 --decode 2 --prompt-len 16 \
#     --new-tokens 3 --repeats 1" RESULT=/tmp/dry.json bash benchmarks/gpu_check.sh   # a dry run on a CPU
set -uo pipefail

OUT=${OUT:-gpu_check}
WORK="$OUT/work"
DEVICE=${DEVICE:-cuda}
LARGE=${LARGE:-7b}
SMALL=${SMALL:-1b}
PARTS=${PARTS:-"cmoe more tomoe dsmoe"}
TRAIN_STEPS=${TRAIN_STEPS:-5}
BENCH_ARGS=${BENCH_ARGS:-}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
RESULT=${RESULT:-benchmarks/results/gpu_check.json}
CALIB=${CALIB:-../shared/assets/data/wikitext2/valid.txt}
EVAL=${EVAL:-../shared/assets/data/wikitext2_raw/wiki.test.raw.txt}
HERE=$(dirname "$0")
mkdir -p "$WORK"
if [ "$DEVICE" = cuda ]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 1
fi
head -c 100000 "$EVAL" > "$OUT/eval.txt"
failed=()

step() {  # step NAME COMMAND...: run with the step timeout, its output in $OUT/NAME.log (and on screen)
  local name=$1; shift
  echo "== $name: $*"
  if ! timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"; then
    echo "== $name FAILED (or timed out after $STEP_TIMEOUT s): see $OUT/$name.log"
    failed+=("$name")
  fi
}

wanted() { [[ " $PARTS " == *" $1 "* ]]; }

convert() {  # convert NAME SHAPE METHOD [OPTIONS...]: a bfloat16 conversion on the device, then both benches
  local name=$1 shape=$2 method=$3; shift 3
  step "$name" python -m moeify convert "$WORK/dense_$shape" --method "$method" "$@" --device "$DEVICE" \
    --dtype bfloat16 --calib "$CALIB" --eval "$OUT/eval.txt" --seq-len 2048 --out "$WORK/$name" --overwrite
}

bench() {  # bench NAME: eager and compiled `moeify bench` of a conversion against its dense model
  local name=$1
  [ -f "$WORK/$name/record.json" ] || return 0
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  step "${name}_bench_eager" python -m moeify bench "$WORK/$name" --device "$DEVICE" --dtype bfloat16 $BENCH_ARGS \
    --json "$WORK/${name}_bench_eager.json" --overwrite
  # shellcheck disable=SC2086
  step "${name}_bench_compiled" python -m moeify bench "$WORK/$name" --device "$DEVICE" --dtype bfloat16 --compile \
    $BENCH_ARGS --json "$WORK/${name}_bench_compiled.json" --overwrite
}

for shape in $(printf '%s\n' "$LARGE" "$SMALL" | sort -u); do
  [ -d "$WORK/dense_$shape" ] || step "build_$shape" python "$HERE/gpu_speed.py" build "$shape" "$WORK/dense_$shape"
done
if wanted cmoe; then convert cmoe "$LARGE" cmoe --set spec=S1A1E8; bench cmoe; fi
if wanted more; then convert more "$LARGE" more --no-speed; fi
if wanted tomoe; then convert tomoe "$SMALL" tomoe --set active_ratio=0.5 --set steps="$TRAIN_STEPS"; bench tomoe; fi
if wanted dsmoe; then convert dsmoe "$SMALL" dsmoe --set active_ratio=0.5 --set steps="$TRAIN_STEPS"; bench dsmoe; fi
mkdir -p "$(dirname "$RESULT")"
step summarize python "$HERE/gpu_speed.py" summarize "$WORK" "$RESULT"
cp "$RESULT" "$OUT/" 2>/dev/null || true

if [ -n "${MODEL:-}" ]; then  # a real checkpoint: bfloat16 quality against float32 on the same GPU
  for method in cmoe more static_prune; do
    for dtype in float32 bfloat16; do
      step "real_${method}_$dtype" python -m moeify convert "$MODEL" --method "$method" --device "$DEVICE" \
        --dtype "$dtype" --calib "$CALIB" --eval "$OUT/eval.txt" --seq-len 2048 --out "$OUT/$method-$dtype" --overwrite
    done
    step "real_${method}_gap" python - "$OUT/$method-float32/record.json" "$OUT/$method-bfloat16/record.json" <<'PY'
import json, sys
fp32, bf16 = (json.load(open(path)) for path in sys.argv[1:])
gap = abs(bf16["metrics"]["ppl"] / fp32["metrics"]["ppl"] - 1)
print(f"{fp32['method']}: ppl float32 {fp32['metrics']['ppl']:.3f}, bfloat16 {bf16['metrics']['ppl']:.3f} ({100 * gap:.2f} %)")
assert gap < 0.01, "bfloat16 perplexity is not within 1 % of float32"
PY
  done
fi

if [ "$DEVICE" = cuda ] && [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  options=(--set steps=4 --set batch_size=4 --set checkpoint_every=0 --set analyses=false)
  step nccl_1 python -m moeify convert "$WORK/dense_$SMALL" --method dsmoe --device cuda --calib "$CALIB" --no-speed \
    "${options[@]}" --out "$OUT/dsmoe-1" --overwrite
  for mode in replicated fsdp; do
    step "nccl_2_$mode" torchrun --nproc_per_node 2 -m moeify convert "$WORK/dense_$SMALL" --method dsmoe --device cuda \
      --calib "$CALIB" --no-speed "${options[@]}" --out "$OUT/dsmoe-2-$mode" --overwrite $([ "$mode" = fsdp ] && echo --fsdp)
    step "nccl_2_${mode}_weights" python - "$OUT/dsmoe-1/model.safetensors" "$OUT/dsmoe-2-$mode/model.safetensors" "$mode" <<'PY'
import sys
from safetensors.torch import load_file
one, two = (load_file(path) for path in sys.argv[1:3])
gap = max(float((one[k].float() - two[k].float()).abs().max()) for k in one)
print(f"dsmoe over NCCL, 2 processes ({sys.argv[3]}) against 1: largest weight difference {gap:.2e}")
assert gap < 1e-4, "two processes do not end at the one-process weights"
PY
  done
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed steps: ${failed[*]} (logs in $OUT/)"
  exit 1
fi
echo "every step ran; the lines and whether they hold: $RESULT"
