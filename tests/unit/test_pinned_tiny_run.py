"""Regression numbers: a fixed tiny run must reproduce the losses, rewards and gradient norms committed here.

The run is the ``tiny-cpu-smoke`` preset (2 GRPO steps on CNN/DailyMail summaries, seed 0,
``--deterministic``), float32 on CPU. Any change to sampling, scoring, advantages, datum assembly, the
loss or the optimizer that moves these numbers fails this test; a deliberate change regenerates
``pinned/tiny_smoke.json`` with ``RLRUNBOOK_UPDATE_PINNED=1 pytest tests/unit/test_pinned_tiny_run.py``
and says why in the commit. Pinned on torch 2.13.0 (CPU build); the tolerance (rel 1e-5) absorbs
summation-order noise, not behaviour.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlrunbook import cli

PINNED = Path(__file__).parent / "pinned" / "tiny_smoke.json"
KEYS = ("loss/sum", "loss_pg", "reward/mean", "task_reward/mean", "advantage/min", "advantage/max",
        "num_trained_tokens", "grad_norm", "completion_length/mean")


def _run(tmp_path: Path) -> list[dict]:
    code = cli.main(["train", "--config-file", "tiny-cpu-smoke", "checkpoint.every=0", "--deterministic",
                     "--log-root", str(tmp_path)])
    assert code == 0
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in KEYS} for row in rows]


def test_tiny_smoke_run_reproduces_the_pinned_numbers(tmp_path):
    rows = _run(tmp_path)
    if os.environ.get("RLRUNBOOK_UPDATE_PINNED") == "1":
        PINNED.write_text(json.dumps({"torch": __import__("torch").__version__, "rows": rows}, indent=1) + "\n")
        pytest.skip(f"rewrote {PINNED}")
    pinned = json.loads(PINNED.read_text())["rows"]
    assert len(rows) == len(pinned)
    for step, (row, expected) in enumerate(zip(rows, pinned, strict=True)):
        for key in KEYS:
            assert row[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), f"step {step} {key}"
