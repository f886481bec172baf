#!/usr/bin/env bash
# Set everything up, then run the main job on the built-in default model (SmolLM2-135M-Instruct),
# in the runbook's order:
#   1. the logprob consistency check (sampler and trainer agree on the same tokens), on what step 2 trains:
#      the same model, LoRA rank, temperature, and backend device, dtype and sampler;
#   2. the mini debate RS→GRPO experiment on CNN/DailyMail summaries, at a CPU-sized shape;
#   3. the rubric checker on the run directory it wrote (train runs it before it exits).
# Extra arguments go to `rlrunbook train` (e.g. `--model tiny -s 5`), and reach step 1 where they choose
# what it checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-100000000000}"
export PYTHONUNBUFFERED=1 USE_TF=0 TRANSFORMERS_NO_TF=1 TRANSFORMERS_NO_FLAX=1
bin="${RLRUNBOOK_VENV:-.venv}/bin"
train_args=(--mode debate --env summary --dataset cnn_dailymail --reward-fn compression
  -n 16 --num-groups 2 -s 3 --max-tokens 32 --mock-judge --debate-train rs_grpo --debate-grpo-reward task
  --name mini_debate_rs_grpo_summary "$@")
check_args=$("$bin/rlrunbook" show-config --check-logprobs-args "${train_args[@]}")
mapfile -t check <<< "$check_args"
"$bin/rlrunbook" check-logprobs --prompt "What is 7 * 8?" --max-tokens 32 "${check[@]}"
"$bin/rlrunbook" train "${train_args[@]}"
