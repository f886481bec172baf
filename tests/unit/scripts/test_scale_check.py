"""scripts/scale_check.py's gate with a fake measurement: a memory plan below the measured peak fails the script
(exit 1, naming both numbers), and the verdict is written into scale.json for the report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
GIB = 1 << 30


def _scale_check():
    spec = importlib.util.spec_from_file_location("scale_check", REPO_ROOT / "scripts" / "scale_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_check"] = module
    spec.loader.exec_module(module)
    return module


def _measured(sampling: int | None, training: int | None) -> dict:
    return {"device": "cuda", "planned_sampling_peak": 28 * GIB, "planned_training_peak": 71 * GIB,
            "sampling_peak_bytes": sampling, "training_peak_bytes": training, "plan": ["fits: ..."]}


def test_a_plan_below_the_measured_peak_fails_naming_both(tmp_path, monkeypatch, capsys):
    module = _scale_check()
    monkeypatch.setattr(module, "measure", lambda args, out: _measured(32 * GIB, 70 * GIB))
    assert module.main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "sampling peak 32.00 GiB measured is above the plan's 28.00 GiB" in err
    assert "training" not in err  # 70 GiB measured is inside the 71 planned
    report = json.loads((tmp_path / "scale.json").read_text())
    assert report["plan_judged"] == ["sampling", "training"] and len(report["plan_failures"]) == 1


def test_a_plan_that_held_passes_and_an_unmeasured_one_is_not_judged(tmp_path, monkeypatch, capsys):
    module = _scale_check()
    monkeypatch.setattr(module, "measure", lambda args, out: _measured(27 * GIB, 71 * GIB))
    assert module.main(["--out", str(tmp_path)]) == 0  # equal to the plan is inside it
    monkeypatch.setattr(module, "measure", lambda args, out: _measured(None, None))
    assert module.main(["--out", str(tmp_path)]) == 0
    assert "plan not judged: no peak measured" in capsys.readouterr().err
    assert json.loads((tmp_path / "scale.json").read_text())["plan_judged"] == []
    both = module.plan_failures(_measured(29 * GIB, 72 * GIB))
    assert [line.split(" peak")[0] for line in both] == ["sampling", "training"]
