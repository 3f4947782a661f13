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
#   DEADLINE_S=540 COMPILED_BENCH_ARGS="--prefill 8x256 --decode 1,32" bash benchmarks/gpu_check.sh  # a short lease
# Order: the conversions with their eager benches, then the compiled benches (compiling takes the longest), then
# MoRE's conversion; with DEADLINE_S, no step outlives that many seconds from the start (a step cut short is a
# failed step), so whatever ran is summarised. A conversion or bench whose output is in WORK already is not run
# again: a second run of the script (other PARTS, a new deadline) continues where the first one stopped.
set -uo pipefail

OUT=${OUT:-gpu_check}
WORK=${WORK:-$OUT/work}
DEVICE=${DEVICE:-cuda}
LARGE=${LARGE:-7b}
SMALL=${SMALL:-1b}
PARTS=${PARTS:-"cmoe more tomoe dsmoe"}
COMPILED_PARTS=${COMPILED_PARTS-"cmoe tomoe dsmoe"}  # the conversions benched compiled too
TRAIN_STEPS=${TRAIN_STEPS:-5}
BENCH_ARGS=${BENCH_ARGS:-}
COMPILED_BENCH_ARGS=${COMPILED_BENCH_ARGS:-$BENCH_ARGS}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
DEADLINE_S=${DEADLINE_S:-}
STARTED=$SECONDS
RESULT=${RESULT:-benchmarks/results/gpu_check.json}
CALIB=${CALIB:-../shared/assets/data/wikitext2/valid.txt}
EVAL=${EVAL:-../shared/assets/data/wikitext2_raw/wiki.test.raw.txt}
HERE=$(dirname "$0")
mkdir -p "$OUT" "$WORK"
if [ "$DEVICE" = cuda ]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 1
fi
head -c 100000 "$EVAL" > "$OUT/eval.txt"
failed=()

step() {  # step NAME COMMAND...: run with the step timeout, its output in $OUT/NAME.log (its last lines on screen)
  local name=$1; shift
  local limit=$STEP_TIMEOUT began=$SECONDS
  if [ -n "$DEADLINE_S" ]; then
    limit=$(( DEADLINE_S - (SECONDS - STARTED) < limit ? DEADLINE_S - (SECONDS - STARTED) : limit ))
  fi
  if [ "$limit" -le 0 ]; then
    echo "== $name SKIPPED: the deadline of $DEADLINE_S s has passed"
    failed+=("$name"); return
  fi
  echo "== $name (at most $limit s): $*"
  # into a file, not through a pipe: a process the command leaves behind (torch.compile's workers) would hold a
  # pipe open past the time limit; --kill-after: a command that ignores the TERM is killed
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  tr '\r' '\n' < "$OUT/$name.log" | grep -v 'it/s\]\|s/it\]\|^\s*$' | tail -n 20
  if [ "$status" -ne 0 ]; then
    echo "== $name FAILED (status $status; 124: timed out after $limit s): see $OUT/$name.log"
    failed+=("$name")
  fi
  echo "== $name took $(( SECONDS - began )) s"
}

wanted() { [[ " $PARTS " == *" $1 "* ]]; }

convert() {  # convert NAME SHAPE METHOD [OPTIONS...]: a bfloat16 conversion on the device
  local name=$1 shape=$2 method=$3; shift 3
  if [ -f "$WORK/$name/record.json" ]; then echo "== $name: converted already ($WORK/$name)"; return; fi
  step "$name" python -m moeify convert "$WORK/dense_$shape" --method "$method" "$@" --device "$DEVICE" \
    --dtype bfloat16 --calib "$CALIB" --eval "$OUT/eval.txt" --seq-len 2048 --out "$WORK/$name" --overwrite
}

bench() {  # bench NAME MODE: `moeify bench` (eager or compiled) of a conversion against its dense model
  local name=$1 mode=$2
  [ -f "$WORK/$name/record.json" ] || return 0
  local done_json="$WORK/${name}_bench_$mode.json"  # a bench cut short left its shapes so far, marked partial
  if [ -f "$done_json" ] && ! grep -q '"partial"' "$done_json"; then
    echo "== ${name}_bench_$mode: benched already"; return
  fi
  local flags=$BENCH_ARGS
  [ "$mode" = compiled ] && flags="--compile $COMPILED_BENCH_ARGS"
  # shellcheck disable=SC2086  # flags is a list of flags
  step "${name}_bench_$mode" python -m moeify bench "$WORK/$name" --device "$DEVICE" --dtype bfloat16 $flags \
    --json "$done_json" --overwrite
}

for shape in $(printf '%s\n' "$LARGE" "$SMALL" | sort -u); do
  [ -d "$WORK/dense_$shape" ] || step "build_$shape" python "$HERE/gpu_speed.py" build "$shape" "$WORK/dense_$shape"
done
# the conversions' own speed pass is left out: moeify bench measures more shapes, eager and compiled
if wanted cmoe; then convert cmoe "$LARGE" cmoe --set spec=S1A1E8 --no-speed; bench cmoe eager; fi
if wanted tomoe; then
  convert tomoe "$SMALL" tomoe --set active_ratio=0.5 --set steps="$TRAIN_STEPS" --no-speed; bench tomoe eager
fi
if wanted dsmoe; then
  convert dsmoe "$SMALL" dsmoe --set active_ratio=0.5 --set steps="$TRAIN_STEPS" --no-speed; bench dsmoe eager
fi
for name in $COMPILED_PARTS; do if wanted "$name"; then bench "$name" compiled; fi; done
if wanted more; then convert more "$LARGE" more --no-speed; fi
mkdir -p "$(dirname "$RESULT")"
# the summary runs past the deadline too: it reads what the steps wrote (seconds)
timeout 120 python "$HERE/gpu_speed.py" summarize "$WORK" "$RESULT" > "$OUT/summarize.log" 2>&1 || failed+=(summarize)
cat "$OUT/summarize.log"
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
