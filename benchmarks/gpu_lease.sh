#!/usr/bin/env bash
# gpu_check.sh on a GPU machine lent for a few minutes with no network (../shared/gpu/README.md): the carried
# wheels installed, then the check in phases by priority under one deadline, each phase's results copied to
# $OUT as soon as it ends, so a call cut short still returns what was measured. Prepared here, once:
#   bash ../shared/gpu/wheels.sh     # plus wheels of gguf (`moeify` imports it) and pytest, pluggy, iniconfig
#   mkdir -p .gpu && cp ../shared/assets/data/wikitext2/valid.txt .gpu/
#   head -c 100000 ../shared/assets/data/wikitext2_raw/wiki.test.raw.txt > .gpu/eval.txt
# then one device call carrying .whl and .gpu, its time limit above END (seconds from the start; default 500):
#   timeout 560 bash benchmarks/gpu_lease.sh
# and, at once while the machine is warm, a second call with what the lease has left (END=200, say) to go on.
# Phases: the CUDA tests; CMoE of the 7B shape with its eager bench; CMoE's compiled bench (compiling the 7B shape
# may take minutes for each shape and model); ToMoE and DSMoE of the 1.1B shape with their eager benches; MoRE's
# conversion; kernel profiles of what was converted (gpu_profile.py); ToMoE's and DSMoE's compiled benches.
# The folders stay on the machine (WORK), so a second call while it is warm continues where this one stopped.
set -uo pipefail
RETURN=${OUT:-/tmp/gpu_lease}
END=${END:-500}
T0=$SECONDS
mkdir -p "$RETURN" /tmp/gc
# gpu_check.sh calls `python`; the machine has python3 only (a link would lose its virtual environment), so a
# script in a new folder (never written through a path that may be a link to an interpreter)
BIN=$(mktemp -d)
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$BIN/python" && chmod +x "$BIN/python"
export PATH=$BIN:$PATH
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "the carried wheels did not install"
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$RETURN/gpu.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

collect() {  # the summary, every bench and record as small files in $OUT (logs in one archive)
  mkdir -p /tmp/gc/json
  for f in /tmp/gcwork/*.json /tmp/gcwork/*/record.json; do
    [ -f "$f" ] && cp "$f" "/tmp/gc/json/$(echo "${f#/tmp/gcwork/}" | tr / _)"
  done
  cp /tmp/gc/gpu_check.json "$RETURN/" 2>/dev/null
  tar czf "$RETURN/logs.tgz.part" -C /tmp gc 2>/dev/null && mv "$RETURN/logs.tgz.part" "$RETURN/logs.tgz"
}

phase() {  # phase UNTIL VAR=VALUE...: gpu_check.sh with those settings, ending by UNTIL seconds from the start
  local until=$1; shift
  local left=$(( until - (SECONDS - T0) ))
  echo "#### $* (until $until s; now $(( SECONDS - T0 )) s)"
  [ "$left" -gt 10 ] || { echo "#### skipped: no time left"; return; }
  env OUT=/tmp/gc WORK=/tmp/gcwork CALIB=.gpu/valid.txt EVAL=.gpu/eval.txt RESULT=/tmp/gc/gpu_check.json \
    DEADLINE_S="$left" "$@" bash "$(dirname "$0")/gpu_check.sh"
  collect
}

# the tests that need a CUDA device (seconds; they skip on a CPU)
if [ ! -f /tmp/gc/gpu_tests.done ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/unit/test_cmoe.py tests/unit/test_few_pairs.py \
    -k "cuda" > /tmp/gc/gpu_tests.log 2>&1 && touch /tmp/gc/gpu_tests.done
  tail -n 3 /tmp/gc/gpu_tests.log
fi

phase $(( END * 35 / 100 )) PARTS=cmoe COMPILED_PARTS=
# the lines' shapes only; the bench keeps each shape as it finishes (a cut run leaves those marked partial)
phase $(( END * 65 / 100 )) PARTS=cmoe COMPILED_PARTS=cmoe \
  COMPILED_BENCH_ARGS="--prefill 8x256 --decode 1,32 --repeats 3"
phase $(( END * 85 / 100 )) PARTS="tomoe dsmoe" COMPILED_PARTS=
phase "$END" PARTS=more
# where the time goes, kernel by kernel (eager), for what was converted; then ToMoE's and DSMoE's compiled prefill
for name in cmoe tomoe dsmoe; do
  left=$(( END - (SECONDS - T0) ))
  if [ -f "/tmp/gcwork/$name/record.json" ] && [ ! -f "/tmp/gc/profile_$name.log" ] && [ "$left" -gt 40 ]; then
    timeout $(( left < 90 ? left : 90 )) python3 benchmarks/gpu_profile.py "/tmp/gcwork/$name" --shapes 8x256,1x1,32x1 \
      > "/tmp/gc/profile_$name.part" 2>&1
    mv "/tmp/gc/profile_$name.part" "/tmp/gc/profile_$name.log"
  fi
done
collect
phase "$END" PARTS="tomoe dsmoe" COMPILED_PARTS="tomoe dsmoe" COMPILED_BENCH_ARGS="--prefill 8x256 --decode 1 --repeats 3"
echo "#### done at $(( SECONDS - T0 )) s"; ls -la "$RETURN"
