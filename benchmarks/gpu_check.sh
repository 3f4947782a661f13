#!/usr/bin/env bash
# What only a GPU machine can confirm, run where one is available (from the repository root, moeify
# installed): bfloat16 conversion and evaluation on CUDA (perplexity within 1 % of float32 on the same GPU),
# `moeify plan`'s CUDA estimate against the measured peak (record.json's memory.peak_device_gib), the
# speed of a converted model against the dense one in bfloat16, and, with two or more GPUs, data-parallel
# training over NCCL (replicated, and sharded with --fsdp) ending at the one-process weights. Every result
# lands in $OUT (default gpu_check/).
# Exits non-zero at the first check that fails.
#
#   MODEL=path/to/hf-model bash benchmarks/gpu_check.sh
set -euo pipefail

OUT=${OUT:-gpu_check}
MODEL=${MODEL:-../shared/assets/models/smollm2-135m-instruct}
EVAL=${EVAL:-../shared/assets/data/wikitext2_raw/wiki.test.raw.txt}
CALIB=${CALIB:-../shared/assets/data/wikitext2/valid.txt}
mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"
head -c 100000 "$EVAL" > "$OUT/eval.txt"

for method in cmoe more static_prune; do
  for dtype in float32 bfloat16; do
    python -m moeify convert "$MODEL" --method "$method" --device cuda --dtype "$dtype" --calib "$CALIB" \
      --eval "$OUT/eval.txt" --seq-len 2048 --out "$OUT/$method-$dtype" --overwrite
  done
  python - "$OUT/$method-float32/record.json" "$OUT/$method-bfloat16/record.json" <<'PY'
import json, sys
fp32, bf16 = (json.load(open(path)) for path in sys.argv[1:])
gap = abs(bf16["metrics"]["ppl"] / fp32["metrics"]["ppl"] - 1)
memory = bf16["memory"]
print(f"{fp32['method']}: ppl float32 {fp32['metrics']['ppl']:.3f}, bfloat16 {bf16['metrics']['ppl']:.3f} "
      f"({100 * gap:.2f} %); peak {memory['peak_device_gib']} GiB on the GPU, planned {memory['plan_gib']} GiB; "
      f"speed-up {bf16['speed']['speedup']:.2f}x")
assert gap < 0.01, "bfloat16 perplexity is not within 1 % of float32"
assert abs(memory["plan_gib"] / memory["peak_device_gib"] - 1) < 0.25, "the plan is off by more than 25 %"
PY
done

if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  options=(--set steps=4 --set batch_size=4 --set checkpoint_every=0 --set analyses=false)
  python -m moeify convert "$MODEL" --method dsmoe --device cuda --calib "$CALIB" --no-speed \
    "${options[@]}" --out "$OUT/dsmoe-1" --overwrite
  for mode in replicated fsdp; do
    torchrun --nproc_per_node 2 -m moeify convert "$MODEL" --method dsmoe --device cuda --calib "$CALIB" \
      --no-speed "${options[@]}" --out "$OUT/dsmoe-2-$mode" --overwrite $([ "$mode" = fsdp ] && echo --fsdp)
    python - "$OUT/dsmoe-1/model.safetensors" "$OUT/dsmoe-2-$mode/model.safetensors" "$mode" <<'PY'
import sys
from safetensors.torch import load_file
one, two = (load_file(path) for path in sys.argv[1:3])
gap = max(float((one[k].float() - two[k].float()).abs().max()) for k in one)
print(f"dsmoe over NCCL, 2 processes ({sys.argv[3]}) against 1: largest weight difference {gap:.2e}")
assert gap < 1e-4, "two processes do not end at the one-process weights"
PY
  done
else
  echo "one GPU: the NCCL data-parallel check needs two"
fi
echo "all GPU checks passed; results in $OUT/"
