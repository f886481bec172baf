#!/usr/bin/env bash
# Set everything up, then run the main job on the built-in default model (SmolLM2-135M-Instruct):
# the logprob consistency check, which must pass before any training is trusted.
# Extra arguments go to `rlrunbook check-logprobs`, e.g. `--model tiny --temperature 0.7 --top-p 0.9`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-100000000000}"
export PYTHONUNBUFFERED=1 USE_TF=0 TRANSFORMERS_NO_TF=1 TRANSFORMERS_NO_FLAX=1
exec "${RLRUNBOOK_VENV:-.venv}/bin/rlrunbook" check-logprobs "$@"
