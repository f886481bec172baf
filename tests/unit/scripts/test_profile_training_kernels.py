"""scripts/profile_training_kernels.py times one forward_backward and each fixed-order kernel call inside it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_kernels_of_one_forward_backward_are_timed_by_shape():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "profile_training_kernels.py"), "--model",
                             "tiny", "--prompts", "2", "--samples", "2", "--prompt-tokens", "8", "--new-tokens", "6",
                             "--top", "40"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    head = re.search(r"forward_backward ([\d.]+) s \(1 micro-batch\(es\) of at most (\d+) distinct tokens\): "
                     r"kernels ([\d.]+) s, outside them (-?[\d.]+) s", result.stdout)
    assert head, result.stdout
    total, tokens, inside = float(head[1]), int(head[2]), float(head[3])
    assert tokens == 2 * (8 + 2 * 5) and 0 < inside <= total  # each group: its prompt once, 5 inputs per sample
    rows = re.findall(r"^\s+([\d.]+)\s+(\d+)\s+(\w+)\s+\[", result.stdout, flags=re.M)
    kinds = {name for _, _, name in rows}
    assert {"gemm_nt", "gemm_seq", "attention_forward", "attention_backward"} <= kinds
    assert sum(float(seconds) for seconds, _, _ in rows) == pytest.approx(inside, abs=0.01)
