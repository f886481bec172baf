"""Regression numbers: a fixed tiny run must reproduce the losses, rewards and gradient norms committed here.

The run is the ``tiny-cpu-smoke`` preset (2 GRPO steps on news summaries, seed 0, ``--deterministic``),
float32 on CPU, on the data the preset gets in a fresh clone: no local CNN/DailyMail copy and no hub, so
``cnn_dailymail`` is the embedded synthetic news set. That set is part of the package, so the numbers are
the same with or without real data beside the checkout; its fingerprint is pinned too, so a change of the
data is named as such. Any change to sampling, scoring, advantages, datum assembly, the
loss or the optimizer that moves these numbers fails this test; a deliberate change regenerates
``pinned/tiny_smoke.json`` with ``RLRUNBOOK_UPDATE_PINNED=1 pytest tests/unit/rl/training/test_pinned_tiny_run.py``
and says why in the commit. Pinned on torch 2.13.0 (CPU build); the tolerance (rel 1e-5) absorbs
summation-order noise, not behaviour. A loss is a sum of terms of about 0.1 that can cancel: on-policy
it is minus the sum of the trained tokens' advantages, and a group's centred advantages cancel when its
completions train equally many tokens (step 0 here: 256 tokens, loss 5.6e-7). So losses are compared to
1e-5 absolutely, above the float32 rounding of such a sum (about 1e-6) and far below any real change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlrunbook import cli
from rlrunbook.rl.data import DATA_DIR_ENV

PINNED = Path(__file__).parent / "pinned" / "tiny_smoke.json"
KEYS = ("loss/sum", "loss_pg", "reward/mean", "task_reward/mean", "advantage/min", "advantage/max",
        "num_trained_tokens", "grad_norm", "completion_length/mean")
ABS = {"loss/sum": 1e-5, "loss_pg": 1e-5}  # sums that cancel (see above); everything else: 1e-7


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list[dict]]:
    """The run's data set (source and fingerprint) and its per-step numbers."""
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "no-data"))  # no local copy, wherever the checkout is
    monkeypatch.setattr("rlrunbook.rl.rollout.tasks.hub_unreachable", lambda: "pinned on the embedded set")
    logs = tmp_path / "logs"
    code = cli.main(["train", "--config-file", "tiny-cpu-smoke", "checkpoint.every=0", "--deterministic",
                     "--log-root", str(logs)])
    assert code == 0
    (run,) = logs.iterdir()
    dataset = json.loads((run / "run_metadata.json").read_text())["dataset"]
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return {key: dataset[key] for key in ("source", "fingerprint")}, [{key: row[key] for key in KEYS} for row in rows]


def test_tiny_smoke_run_reproduces_the_pinned_numbers(tmp_path, monkeypatch):
    dataset, rows = _run(tmp_path, monkeypatch)
    if os.environ.get("RLRUNBOOK_UPDATE_PINNED") == "1":
        PINNED.write_text(json.dumps({"torch": __import__("torch").__version__, "dataset": dataset, "rows": rows},
                                     indent=1) + "\n")
        pytest.skip(f"rewrote {PINNED}")
    pinned = json.loads(PINNED.read_text())
    assert dataset == pinned["dataset"], "the embedded news set changed: these numbers are pinned on it"
    pinned = pinned["rows"]
    assert len(rows) == len(pinned)
    for step, (row, expected) in enumerate(zip(rows, pinned, strict=True)):
        for key in KEYS:
            assert row[key] == pytest.approx(expected[key], rel=1e-5, abs=ABS.get(key, 1e-7)), f"step {step} {key}"
