#!/usr/bin/env bash
# The GPU validation runbook, in parts that each fit one command on a GPU machine that allows 10 minutes per
# command and brings back at most 8 files, from a copy of the checkout that is thrown away afterwards.
#
#   bash scripts/gpu-check.sh --list                     # the parts, their planned minutes, what they run
#   bash scripts/gpu-check.sh --part NAME [--dry-run]    # on the GPU machine, in the checkout: one part
#   bash scripts/gpu-check.sh --together NAME... [--dry-run]  # several parts side by side on one card
#   bash scripts/gpu-check.sh --merge DIR [DIR ...]      # here: fold the returned sections into the record
#   bash scripts/gpu-check.sh --all                      # a GPU machine of your own: every part, then --merge
#
# A part writes exactly two files to ${OUT:-gpu-check-out}/: NAME.md (its section of docs/gpu-validation.md,
# written by scripts/gpu_report.py) and NAME.tar.gz (its artifacts: JUnit XML, check-logprobs outputs, benchmark
# JSON and JUnit XML, run directories, each step's log, the card's memory in use read by nvidia-smi every second;
# at most 15 MiB, step records dropped first where it would be larger).
# Every step runs under the part's time budget (GPU_CHECK_BUDGET_S; default: its planned minutes and one more, at
# least 450 s and at most 540 s, inside the machine's 10 minutes per command), so a slow step
# is stopped and reported as timed out instead of losing the whole command. --dry-run lists each step instead of
# running it (nothing measured; the two files are still written), for checking the mechanism without a GPU.
# --merge DIR... appends the sections found in DIR/*.md to docs/gpu-validation.md (or --doc PATH), skipping any
# already there. --together runs the named parts at once, each within its own budget, for a lease too short to
# run them one after another: their outcomes and numerics are as alone, and each section says which parts shared
# the card (its times are then upper bounds). A section also names the TINKER_LOCAL_* variables set for its run.
#
# Adding a part: write a function part_NAME that runs its steps with `step`, writing into "$work"; add NAME to
# PARTS with its planned minutes and a line about it; give scripts/gpu_report.py a renderer for its figures.
# (Sourcing this file defines the functions without running anything: tests add a part that way.)
#
# Needs the project importable (pip install -e . or PYTHONPATH=src) and nothing from the network.
# Exit status: 1 if a gated step of the part failed or timed out, 2 for a usage error, else 0.
set -uo pipefail
py="${PYTHON:-python3}"

# name|planned minutes on one H100 (tiny and smollm2-135m)|what it runs
PARTS=(
  "tier|6|the gpu tier (tests/gpu) on RLRUNBOOK_GPU_MODELS (tiny, smollm2-135m), RLRUNBOOK_REQUIRE_GPU=1"
  "parity|4|check-logprobs on smollm2-135m, 16 x 128: fp32 invariant, bf16 invariant/exact/native, T=1 and T=0.7"
  "bench|6|the benchmarks: decode, sampling, batching, training, RL step, peer against TRL where installed"
  "debate|3|the runbook's mini debate RS->GRPO at full shape (-n 64, 4 groups, 10 steps) and its rubric"
  "scale|8|one step of the h100-rlvr shape (1.5B config, random weights): peak memory vs the plan, phases, decode ms/step, MFU"
  "full|8|one full-parameter step of the h100-rlvr-full shape (1.5B config, random weights, every weight trained, KL reference): peak memory vs the plan, phases, MFU"
  "invariance|4|scripts/invariance_check.py on smollm2-135m bf16: batch compositions bitwise, sampler vs trainer, default vs native time"
  "speed|8|the speed targets (scripts/speed_check.py): decode ms/step (smollm2 16x64, 1.5B shape 64x256), forward_backward MFU (1.5B shape), mini debate s/step (4 steps), rlrunbook vs TRL GRPOTrainer (1.5B shape, 16x4x256), 4 serve clients sampling at once vs one (smollm2), then one h100-rlvr step until the budget"
)
ARCHIVE_LIMIT_BYTES=$((15 * 1024 * 1024))

usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
}

part_budget() {  # part_budget PLANNED_MINUTES: the part's budget in seconds
  if [ -n "${GPU_CHECK_BUDGET_S:-}" ]; then echo "$GPU_CHECK_BUDGET_S"; return; fi
  local seconds=$((($1 + 1) * 60))
  [ "$seconds" -lt 450 ] && seconds=450
  [ "$seconds" -gt 540 ] && seconds=540
  echo "$seconds"
}

part_field() {  # part_field NAME FIELD(1: name, 2: minutes, 3: what): empty when NAME is not a part
  local entry
  for entry in "${PARTS[@]}"; do
    if [ "${entry%%|*}" = "$1" ]; then echo "$entry" | cut -d'|' -f"$2"; return; fi
  done
}

list_parts() {
  local entry
  for entry in "${PARTS[@]}"; do
    IFS='|' read -r name minutes what <<<"$entry"
    printf '%-10s %3s min  %s\n' "$name" "$minutes" "$what"
  done
}

# step NAME gated|ungated CMD...: run CMD (output to "$work/NAME.log", its tail echoed) within what is left of
# the budget; record "NAME<TAB>status<TAB>seconds<TAB>gated" in "$work/steps.tsv".
step() {
  local name=$1 gated=$2; shift 2
  local left=$((BUDGET_S - SECONDS)) started=$SECONDS code
  echo "== $name"
  if [ "$dry_run" = 1 ]; then
    echo "   (dry run) $*"
    printf '%s\tdry-run\t0\t%s\n' "$name" "$gated" >>"$work/steps.tsv"
    return 0
  fi
  if [ "$left" -le 5 ]; then
    echo "   not run: the part's ${BUDGET_S} s are spent"
    printf '%s\tskipped\t0\t%s\n' "$name" "$gated" >>"$work/steps.tsv"
    [ "$gated" = gated ] && status=1
    return 0
  fi
  timeout -s INT -k 20 "$left" "$@" >"$work/$name.log" 2>&1
  code=$?
  [ "$code" = 137 ] && code=124  # killed after the interrupt: still a timeout
  tail -n 15 "$work/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - started))" "$gated" >>"$work/steps.tsv"
  if [ "$code" != 0 ] && [ "$gated" = gated ]; then status=1; fi
  return 0
}

part_tier() {
  step gpu-tier gated env RLRUNBOOK_REQUIRE_GPU=1 \
    "$py" -m pytest -m gpu tests/gpu -p no:cacheprovider -rA -q --junitxml="$work/gpu-tier.xml"
}

part_parity() {
  local dtype t numerics
  for dtype in float32 bfloat16; do
    for t in 1.0 0.7; do
      for numerics in invariant exact native; do
        [ "$dtype" = float32 ] && [ "$numerics" != invariant ] && continue
        # native numerics are expected to fail: they are the configuration the gate exists to catch
        step "check-$dtype-T$t-$numerics" "$([ "$numerics" = native ] && echo ungated || echo gated)" \
          "$py" -m rlrunbook check-logprobs --model smollm2-135m --dtype "$dtype" --temperature "$t" \
          --numerics "$numerics" --max-tokens 128 --num-samples 16
      done
    done
  done
}

part_bench() {
  # the JUnit XML holds every benchmark's outcome: the JSON only those that were measured
  step benchmarks gated "$py" -m pytest -m benchmark tests/benchmarks -p no:cacheprovider -q -rs \
    --benchmark-enable --benchmark-json="$work/bench-gpu.json" --junitxml="$work/bench.xml"
}

part_debate() {
  step mini-debate gated "$py" -m rlrunbook train --mode debate --env summary --dataset cnn_dailymail \
    --reward-fn compression -n 64 --num-groups 4 -s 10 --mock-judge --debate-train rs_grpo \
    --debate-grpo-reward task --name mini_debate_rs_grpo_summary --log-root "$work/logs"
}

part_invariance() {
  step invariance gated "$py" scripts/invariance_check.py --device cuda --dtype bfloat16 --json "$work/invariance.json"
}

part_scale() {  # GPU_CHECK_SCALE_ARGS: more arguments, e.g. "--device-memory 80GiB" to plan an H100 on a larger card
  # shellcheck disable=SC2086
  step scale gated "$py" scripts/scale_check.py --out "$work" ${GPU_CHECK_SCALE_ARGS:-}
}

part_full() {  # GPU_CHECK_SCALE_ARGS as for scale
  # shellcheck disable=SC2086
  step full gated "$py" scripts/scale_check.py --out "$work" --config-file h100-rlvr-full --decode-rows 0 \
    ${GPU_CHECK_SCALE_ARGS:-}
}

# GPU_CHECK_SPEED_SIZE=tiny: every step at a toy size on CPU (the tests); GPU_CHECK_SCALE_ARGS as for scale (rlvr step).
# The whole h100-rlvr step goes last: until it fits its target it is what the budget stops, after the rest is measured.
part_speed() {
  local size=${GPU_CHECK_SPEED_SIZE:-gpu} name
  for name in decode-smollm2 decode-1.5b mfu debate peer clients; do
    step "speed-$name" gated "$py" scripts/speed_check.py "$name" --out "$work" --size "$size"
  done
  # shellcheck disable=SC2086
  step speed-rlvr gated "$py" scripts/speed_check.py rlvr --out "$work" --size "$size" -- ${GPU_CHECK_SCALE_ARGS:-}
}

# archive DEST: the part's work folder as DEST (.tar.gz), within ARCHIVE_LIMIT_BYTES; prints a note when it
# had to leave step records out.
archive() {
  tar -czf "$1" -C "$work" .
  if [ "$(stat -c %s "$1")" -gt "$ARCHIVE_LIMIT_BYTES" ]; then
    tar -czf "$1" -C "$work" --exclude='training_step_*.json' --exclude='baseline_*.json' \
      --exclude='summary_*.json' --exclude='debate_*.json' .
    echo "- artifacts: per-step records left out to keep the archive under 15 MiB"
  fi
}

run_part() {
  local part=$1 planned out="${OUT:-gpu-check-out}"
  planned=$(part_field "$part" 2)
  if [ -z "$planned" ]; then
    echo "unknown part '$part'; the parts are:" >&2
    list_parts >&2
    exit 2
  fi
  BUDGET_S=$(part_budget "$planned")
  mkdir -p "$out"
  work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-$part.XXXXXX")
  status=0
  SECONDS=0
  export PYTHONUNBUFFERED=1
  echo "# part $part (planned $planned min, budget ${BUDGET_S} s)$([ "$dry_run" = 1 ] && echo ', dry run')"
  # the card's memory in use, every second while the part runs (every process on it: nvidia-smi sees the card)
  local poller=""
  if [ "$dry_run" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 1000 \
      >"$work/card-memory.csv" 2>/dev/null &
    poller=$!
  fi
  "part_$part"
  if [ -n "$poller" ]; then kill "$poller" 2>/dev/null; wait "$poller" 2>/dev/null; fi
  local elapsed=$SECONDS note
  note=$(archive "$out/$part.tar.gz")
  "$py" scripts/gpu_report.py section "$part" "$work" --status "$status" --planned "$planned" \
    --seconds "$elapsed" --alongside "${GPU_CHECK_ALONGSIDE:-}" $([ "$dry_run" = 1 ] && echo --dry-run) \
    >"$out/$part.md" || status=1
  [ -n "$note" ] && echo "$note" >>"$out/$part.md"
  cat "$out/$part.md"
  rm -rf "$work"
  return "$status"
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
  dry_run=0
  local doc=docs/gpu-validation.md part arg entry failed
  case "${1:-}" in
    --list) list_parts ;;
    --part)
      [ $# -ge 2 ] || usage
      part=$2; shift 2
      for arg in "$@"; do
        if [ "$arg" = --dry-run ]; then dry_run=1; else usage; fi
      done
      run_part "$part" ;;
    --together)
      shift
      local parts=() logs pids=() i
      for arg in "$@"; do
        if [ "$arg" = --dry-run ]; then dry_run=1; else parts+=("$arg"); fi
      done
      [ ${#parts[@]} -ge 1 ] || usage
      for part in "${parts[@]}"; do
        [ -n "$(part_field "$part" 2)" ] || { echo "unknown part '$part'; the parts are:" >&2; list_parts >&2; exit 2; }
      done
      logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-together.XXXXXX")
      for part in "${parts[@]}"; do
        GPU_CHECK_ALONGSIDE=$(printf '%s\n' "${parts[@]}" | grep -vx "$part" | paste -sd, -) \
          run_part "$part" >"$logs/$part.log" 2>&1 &
        pids+=($!)
      done
      failed=0
      for i in "${!parts[@]}"; do
        wait "${pids[$i]}" || failed=1
        echo "######## ${parts[$i]}"
        cat "$logs/${parts[$i]}.log"
      done
      rm -rf "$logs"
      return $failed ;;
    --merge)
      shift
      if [ "${1:-}" = --doc ]; then doc=$2; shift 2; fi
      [ $# -ge 1 ] || usage
      "$py" scripts/gpu_report.py merge "$doc" "$@" ;;
    --all)
      failed=0
      for entry in "${PARTS[@]}"; do
        (run_part "${entry%%|*}") || failed=1
      done
      "$py" scripts/gpu_report.py merge "$doc" "${OUT:-gpu-check-out}" || failed=1
      return $failed ;;
    *) usage ;;
  esac
}

dry_run=0
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
  exit $?
fi
