"""scripts/profile_decode_ops.py counts the ops of a decode step, split into the model step and the rest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_decode_step_is_counted_per_layer_and_outside_the_model():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "profile_decode_ops.py"), "--model", "tiny",
                             "--rows", "4", "--tokens", "8", "--top", "60"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tiny bfloat16, 4 rows x 8 tokens: 7 decode steps" in result.stdout
    counts = re.search(r"(\d+) in the model step \(([\d.]+) per layer of 2\), (\d+) outside it", result.stdout)
    inside, per_layer, outside = int(counts[1]), float(counts[2]), int(counts[3])
    assert inside > 0 and outside > 0 and abs(per_layer * 2 - inside) <= 1
    per_layer_ops = result.stdout.split("in the model step, per layer:")[1].split("outside it")[0]
    assert "rlrunbook::decode_layers" in per_layer_ops  # every layer of a decode step in one call


@pytest.mark.slow
def test_the_cuda_paths_decode_step_is_counted_through_the_triton_kernels():
    """``--triton``: the kernels CUDA runs (interpreted here), each layer's norms, rotations, activation and LoRA
    additions one op each."""
    pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux)")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "profile_decode_ops.py"), "--triton",
                             "--model", "tiny", "--rows", "2", "--tokens", "3", "--top", "60"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tiny bfloat16, 2 rows x 3 tokens: 2 decode steps, Triton kernels" in result.stdout
    per_layer = {name: float(count) for count, name in re.findall(
        r"^\s+([\d.]+)\s+(\S+)$", result.stdout.split("in the model step, per layer:")[1].split("outside it")[0],
        re.MULTILINE)}
    assert per_layer["rlrunbook::rms_norm"] == 2.5 and per_layer["rlrunbook::rotary"] == 2
    assert per_layer["rlrunbook::silu_mul"] == 1 and per_layer["rlrunbook::lora_added"] == 7.5
    assert "aten::rsqrt" not in per_layer and "aten::mul" not in per_layer
