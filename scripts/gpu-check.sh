#!/usr/bin/env bash
# One GPU validation command: the gpu tier, sampler-trainer parity in fp32 and bf16 at T=1 and T=0.7,
# the decode and RL-step benchmarks, and the runbook's mini debate RS->GRPO at full shape; then a dated
# section with every figure is appended to docs/gpu-validation.md.
#
#   bash scripts/gpu-check.sh            # on a CUDA machine, in the checkout (uses ${PYTHON:-python3})
#
# Needs the project importable (pip install -e . or PYTHONPATH=src) and nothing from the network.
# Artifacts go to ${OUT:-gpu-check-out}/ (JUnit XML of the tier, check-logprobs outputs, benchmark
# JSON, the debate run directory). Exit status: 1 if any gated check failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RLRUNBOOK_REQUIRE_GPU=1
status=0
step() { echo; echo "== $*"; }

step "gpu tier (RLRUNBOOK_GPU_MODELS=${RLRUNBOOK_GPU_MODELS:-tiny,smollm2-135m})"
"$py" -m pytest -m gpu tests/gpu -p no:cacheprovider -rA -q --junitxml="$out/gpu-tier.xml" || status=1

step "check-logprobs: smollm2-135m, 16 samples x 128 tokens"
for dtype in float32 bfloat16; do
  for t in 1.0 0.7; do
    for numerics in invariant exact native; do
      [ "$dtype" = float32 ] && [ "$numerics" != invariant ] && continue
      name="check-$dtype-T$t-$numerics"
      "$py" -m rlrunbook check-logprobs --model smollm2-135m --dtype "$dtype" --temperature "$t" \
        --numerics "$numerics" --max-tokens 128 --num-samples 16 > "$out/$name.txt" 2>&1
      code=$?
      echo "$name: exit $code, $(grep -E '^(max|mean)_abs_diff' "$out/$name.txt" | tr '\n' ' ')"
      # native numerics are expected to fail: they are the configuration the gate exists to catch
      if [ "$numerics" != native ] && [ $code -ne 0 ]; then status=1; fi
    done
  done
done

step "benchmarks: decode and RL step (rlrunbook vs TRL where TRL is installed)"
"$py" -m pytest -m benchmark tests/benchmarks -p no:cacheprovider -q --benchmark-enable \
  --benchmark-json="$out/bench-gpu.json" || status=1

step "mini debate RS->GRPO at the runbook's full shape"
"$py" -m rlrunbook train --mode debate --env summary --dataset cnn_dailymail --reward-fn compression \
  -n 64 --num-groups 4 -s 10 --mock-judge --debate-train rs_grpo --debate-grpo-reward task \
  --name mini_debate_rs_grpo_summary --log-root "$out/logs" > "$out/mini-debate.txt" 2>&1 || status=1
tail -n 5 "$out/mini-debate.txt"

step "writing docs/gpu-validation.md"
"$py" scripts/gpu_report.py "$out" docs/gpu-validation.md --status "$status"
exit $status
