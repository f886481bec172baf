"""The examples run as a reader would run them, and do what they say."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_grpo_loop_trains_and_saves_an_adapter_that_moved(tmp_path):
    """`python examples/grpo_loop.py --steps 2` on `tiny`: each step trains on some datums with a finite loss, and
    the saved adapter's B factors (zero before any step) are no longer zero."""
    env = {**os.environ, "TINKER_LOCAL_STORAGE": str(tmp_path / "storage"), "TINKER_BACKEND": "local"}
    result = subprocess.run([sys.executable, str(EXAMPLES / "grpo_loop.py"), "--steps", "2"], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = re.findall(r"^step (\d): reward ([\d.]+), (\d+) datums, loss (\S+)$", result.stdout, re.MULTILINE)
    assert [s[0] for s in steps] == ["0", "1"], result.stdout
    assert all(int(datums) > 0 and math.isfinite(float(loss)) for _, _, datums, loss in steps)
    saved = re.search(r"^saved: tinker://(\S+)/sampler_weights/final$", result.stdout, re.MULTILINE)
    assert saved, result.stdout
    weights = load_file(tmp_path / "storage" / saved[1] / "sampler_weights" / "final" / "adapter_model.safetensors")
    factors_b = [tensor for name, tensor in weights.items() if "lora_B" in name]
    assert factors_b and any(tensor.abs().max() > 0 for tensor in factors_b)
