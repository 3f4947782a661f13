#!/usr/bin/env bash
# A quick look on a GPU machine lent for a few minutes (set up as for gpu_lease.sh: carried .whl and .gpu), in
# about four minutes: the tests that need a CUDA device; 4-layer models of the 7B and 1.1B shapes
# (gpu_speed.py build 7b-4 / 1b-4) converted (CMoE S1A1E8; DSMoE and ToMoE at APR 0.5, two steps), CMoE benched
# against its dense model eager and compiled, every conversion profiled kernel by kernel (gpu_profile.py).
# Per-layer costs show as on the whole model; the fixed parts (embedding, head, generate's own steps) weigh more.
#   timeout 330 bash benchmarks/gpu_probe.sh      # logs in $OUT
set -uo pipefail
R=${OUT:-/tmp/probe}; mkdir -p $R /tmp/pw
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/unit/test_few_pairs.py tests/unit/test_cmoe.py -k cuda > $R/tests.log 2>&1; tail -3 $R/tests.log
echo "tests at $((SECONDS-T0)) s"
head -c 30000 .gpu/eval.txt > /tmp/pw/eval.txt
for shape in 7b-4 1b-4; do timeout 60 python3 benchmarks/gpu_speed.py build $shape /tmp/pw/dense_$shape; done
conv() { local name=$1 shape=$2; shift 2; timeout 120 python3 -m moeify convert /tmp/pw/dense_$shape "$@" --device cuda --dtype bfloat16 --calib .gpu/valid.txt --eval /tmp/pw/eval.txt --seq-len 512 --no-speed --out /tmp/pw/$name --overwrite > $R/conv_$name.log 2>&1; echo "$name converted rc $? at $((SECONDS-T0)) s"; }
conv cmoe 7b-4 --method cmoe --set spec=S1A1E8 --set calib_samples=4
timeout 100 python3 -m moeify bench /tmp/pw/cmoe --device cuda --dtype bfloat16 --prefill 8x256,1x256 --decode 1,32 --new-tokens 16 --repeats 3 > $R/bench_cmoe_eager.log 2>&1; grep -v "it/s" $R/bench_cmoe_eager.log | tail -8
echo "at $((SECONDS-T0)) s"
timeout 100 python3 benchmarks/gpu_profile.py /tmp/pw/cmoe --shapes 8x256,1x1,32x1 --top 25 > $R/profile_cmoe.log 2>&1
echo "profiled at $((SECONDS-T0)) s"
conv dsmoe 1b-4 --method dsmoe --set active_ratio=0.5 --set steps=2
conv tomoe 1b-4 --method tomoe --set active_ratio=0.5 --set steps=2
for name in dsmoe tomoe; do
  timeout 60 python3 benchmarks/gpu_profile.py /tmp/pw/$name --shapes 8x256,1x1 --top 25 > $R/profile_$name.log 2>&1
  echo "$name profiled at $((SECONDS-T0)) s"
done
timeout 150 python3 -m moeify bench /tmp/pw/cmoe --device cuda --dtype bfloat16 --compile --prefill 8x256 --decode 1,32 --new-tokens 16 --repeats 3 > $R/bench_cmoe_compiled.log 2>&1; grep -v "it/s" $R/bench_cmoe_compiled.log | tail -8
echo "done at $((SECONDS-T0)) s"
tar czf $R/logs.tgz -C $R --exclude logs.tgz . 
