#!/usr/bin/env bash
# Set everything up, then run the main job on the built-in default model (SmolLM2-135M-Instruct),
# in the runbook's order:
#   1. the logprob consistency check (sampler and trainer agree on the same tokens);
#   2. the mini debate RS→GRPO experiment on CNN/DailyMail summaries, at a CPU-sized shape;
#   3. the rubric checker on the run directory it wrote (train runs it too; shown again here).
# Extra arguments go to `rlrunbook train` (e.g. `--model tiny -s 5`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-100000000000}"
export PYTHONUNBUFFERED=1 USE_TF=0 TRANSFORMERS_NO_TF=1 TRANSFORMERS_NO_FLAX=1
bin="${RLRUNBOOK_VENV:-.venv}/bin"
"$bin/rlrunbook" check-logprobs --prompt "What is 7 * 8?" --max-tokens 32
"$bin/rlrunbook" train --mode debate --env summary --dataset cnn_dailymail --reward-fn compression \
  -n 16 --num-groups 2 -s 3 --max-tokens 32 --mock-judge --debate-train rs_grpo --debate-grpo-reward task \
  --name mini_debate_rs_grpo_summary "$@"
