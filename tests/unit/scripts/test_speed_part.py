"""The ``speed`` part of scripts/gpu-check.sh: its steps (listed by ``--dry-run``), the table of targets that
scripts/gpu_report.py computes from the steps' JSON, the TRL step without TRL, and the peer workload's shape.

The part's measurements themselves run at a toy size on CPU in tests/e2e/test_e2e_speed_part.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = REPO_ROOT / "scripts"
STEPS = ("decode-smollm2", "decode-1.5b", "mfu", "debate", "peer", "clients", "rlvr")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(tmp_path: Path, **env: str) -> str:
    environment = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), **env}
    result = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh"), "--part", "speed", "--dry-run"], cwd=REPO_ROOT,
                            env=environment, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_dry_run_lists_each_speed_step_at_the_gpu_size_with_the_h100_rlvr_step_last(tmp_path):
    out = _dry_run(tmp_path, GPU_CHECK_SCALE_ARGS="--device-memory 80GiB")
    listed = re.findall(r"^== (\S+)\n   \(dry run\) \S+ scripts/speed_check.py (\S+) --out \S+ --size (\S+)(.*)$", out,
                        re.MULTILINE)
    assert [(name, step, size) for name, step, size, _ in listed] == [(f"speed-{s}", s, "gpu") for s in STEPS]
    assert listed[-1][3] == " -- --device-memory 80GiB"  # the scale part's variable reaches the h100-rlvr step
    assert all(rest == "" for *_, rest in listed[:-1])
    tiny = _dry_run(tmp_path / "tiny", GPU_CHECK_SPEED_SIZE="tiny")
    assert tiny.count("--size tiny") == len(STEPS) and "--size gpu" not in tiny


def _write(folder: Path, step: str, **figures) -> None:
    (folder / f"speed-{step}.json").write_text(json.dumps(figures))


def test_the_speed_table_computes_each_verdict_from_the_steps_figures(tmp_path):
    card = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2, "size": "gpu"}
    _write(tmp_path, "decode-smollm2", value=2.0, shape="16 rows x 64 new tokens (prompts of 32)", **card)  # at target
    _write(tmp_path, "decode-1.5b", value=3.5, shape="64 rows x 256 new tokens (prompts of 300)", **card)
    _write(tmp_path, "mfu", value=41.0, shape="16 rows x 2560 tokens", formula="4 x P x tokens / seconds / peak",
           product_params=1_543_000_000, tokens=40_944, forward_backward_s=0.75, peak_flops=989e12,
           peak_of="H100 dense bf16", **card)
    _write(tmp_path, "rlvr", value=None, at_least=301.4, shape="one step of the h100-rlvr preset", **card)
    _write(tmp_path, "debate", value=2.9, shape="-n 64 --num-groups 4 -s 4", **card)
    _write(tmp_path, "peer", value=None, missing="trl not installed (pip install -e '.[bench]')",
           shape="16 prompts x 4 samples x 256 tokens", **card)
    lines = _module("gpu_report")._speed(tmp_path)
    assert lines[:2] == ["card (as the device reports it): NVIDIA H100 80GB HBM3, 79.2 GiB", "targets met: 3 of 7"]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert rows["decode, SmolLM2-135M"].endswith("| 2 ms/step | <= 2 ms/step | pass |")
    assert rows["decode, Qwen2.5-Math-1.5B shape"].endswith("| 3.5 ms/step | <= 3 ms/step | FAIL |")
    assert rows["forward_backward MFU, 1.5B shape"].endswith("| 41 % | >= 35 % | pass |")
    assert rows["one whole h100-rlvr step"].endswith("| > 301 s (stopped by the budget) | <= 45 s | FAIL |")
    assert rows["mini debate"].endswith("| 2.9 s/step | <= 3 s/step | pass |")
    assert rows["rlrunbook step / TRL GRPOTrainer step, 1.5B shape"].endswith(
        "| not measured: trl not installed (pip install -e '.[bench]') | <= 0.25 x | FAIL |")
    assert any(line.startswith("- MFU: 4 x P x tokens / seconds / peak = 4 x 1,543,000,000 x 40,944") for line in lines)


def test_a_toy_size_or_a_missing_step_never_passes_a_target(tmp_path):
    _write(tmp_path, "decode-smollm2", value=0.5, size="tiny", shape="2 rows x 4 new tokens", device="cpu", gpu=None)
    _write(tmp_path, "rlvr", value=None, at_least=20.0, size="gpu", shape="one step", device="cuda", gpu=None)
    lines = _module("gpu_report")._speed(tmp_path)
    assert lines[:2] == ["device: cpu (no CUDA card reported)", "targets met: 0 of 7"]
    table = "\n".join(lines)
    assert "| 0.5 ms/step | <= 2 ms/step | n/a (tiny size, not the target's shape) |" in table
    assert "| > 20 s (stopped by the budget) | <= 45 s | not finished |" in table  # under the target: unknown
    assert "| decode, Qwen2.5-Math-1.5B shape |  | not measured (no speed-decode-1.5b.json) | <= 3 ms/step | FAIL |" in table


@pytest.mark.parametrize("size, code", [("gpu", 1), ("tiny", 0)])
def test_without_trl_the_peer_step_says_so_and_fails_at_the_gpu_size(tmp_path, monkeypatch, capsys, size, code):
    from rlrunbook.testing import trl

    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setattr(trl, "missing_trl_reason", lambda: "trl not installed (pip install -e '.[bench]')")
    speed_check = _module("speed_check")
    assert speed_check.main(["peer", "--out", str(tmp_path), "--size", size]) == code
    assert "TRL IS NOT INSTALLED HERE: trl not installed" in capsys.readouterr().out
    figures = json.loads((tmp_path / "speed-peer.json").read_text())
    assert figures["value"] is None and figures["missing"].startswith("trl not installed") and figures["size"] == size


def test_the_card_peak_is_chosen_by_the_name_the_device_reports():
    speed_check = _module("speed_check")
    assert speed_check.peak_flops("NVIDIA H100 PCIe") == ("H100 PCIe dense bf16", 756e12)
    assert speed_check.peak_flops("NVIDIA H200") == ("H200 dense bf16", 989e12)
    whose, flops = speed_check.peak_flops("NVIDIA L4")
    assert flops == 989e12 and "no peak known for NVIDIA L4" in whose


def test_the_peer_workload_shape_comes_from_its_variable_and_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "benchmarks"))
    peer = importlib.import_module("peer_workload")
    monkeypatch.delenv(peer.SHAPE_ENV, raising=False)
    assert peer.peer_shape() == peer.PeerShape(4, 4, 64)
    monkeypatch.setenv(peer.SHAPE_ENV, "16x4x256")
    assert peer.peer_shape() == peer.PeerShape(16, 4, 256) and len(set(peer.PROMPTS[:16])) == 16
    for bad in ("17x4x256", "16x1x256", "16x4", "a x b"):
        monkeypatch.setenv(peer.SHAPE_ENV, bad)
        with pytest.raises(ValueError, match=peer.SHAPE_ENV):
            peer.peer_shape()
