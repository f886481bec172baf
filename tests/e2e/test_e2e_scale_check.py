"""The GPU runbook's scale measurement (``scripts/scale_check.py``, ``gpu-check.sh --part scale``) runs end to end
at a toy size on CPU: the published 1.5B architecture cut to one layer, 2 prompts x 2 samples, 16 prompt tokens,
4 new. What it reports on a GPU is the same JSON; this keeps the script working between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _scale_check(out: Path, *args: str) -> dict:
    """``scale_check.py`` at the toy size on CPU (more ``args`` on top); the report it wrote."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale_check.py"), "--out", str(out),
                           "--device", "cpu", "--layers", "1", "--groups", "2", "--samples", "2", "--prompt", "16",
                           "--new", "4", *args], capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "scale.json").read_text())


def test_scale_check_reports_every_figure_at_a_toy_size(tmp_path):
    report = _scale_check(tmp_path, "--decode-rows", "2", "--decode-window", "16")
    assert report["decode_steps"] == 3 and report["micro_batches"] >= 1 and report["trained_tokens"] > 0
    for key in ("sample_s", "forward_backward_s", "optim_s", "tokens_per_s", "mfu", "decode_ms_per_step"):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert report["planned_training_peak"] > report["weights_bytes"] > 0
    assert report["plan"][-1].startswith(("fits:", "DOES NOT FIT:"))


def test_the_full_parameter_step_reports_its_figures_at_a_toy_size(tmp_path):
    """``gpu-check.sh --part full``: the same step training every weight (h100-rlvr-full's plan), no decode benchmark."""
    report = _scale_check(tmp_path, "--decode-rows", "0", "--config-file", "h100-rlvr-full")
    assert report["finetune"] == "full" and "decode_ms_per_step" not in report
    assert report["trained_tokens"] > 0 and report["micro_batches"] >= 1
    for key in ("sample_s", "forward_backward_s", "optim_s", "tokens_per_s", "mfu"):
        assert isinstance(report[key], float) and report[key] > 0, key
    # float32 master weights of the 1-layer cut, sharded over one rank: 4 bytes per parameter
    assert report["weights_bytes"] % 4 == 0 and report["weights_bytes"] > 0
    assert any("every weight gathered" in line for line in report["plan"]), report["plan"]
