#!/usr/bin/env bash
# Set everything up, then run the test tiers that run on this machine (unit + e2e; the gpu tier
# skips without CUDA and fails if RLRUNBOOK_REQUIRE_GPU=1). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m gpu` or `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# glibc would return multi-GB activation buffers to the OS and re-faults them every step.
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-100000000000}"
export PYTHONUNBUFFERED=1 USE_TF=0 TRANSFORMERS_NO_TF=1 TRANSFORMERS_NO_FLAX=1
# Hypothesis tries the same examples on every run (conftest.py); HYPOTHESIS_PROFILE=dev fuzzes instead.
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec "${RLRUNBOOK_VENV:-.venv}/bin/python" -m pytest "$@"
