"""scripts/serve_bench.py's workload: one peer step of one training client, on the backend in process (the script
drives the same calls through the SDK against a server), at the peer workload's shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def test_a_workload_step_samples_the_peer_shape_and_trains(tmp_path, monkeypatch):
    from rlrunbook.backend import LocalServiceClient, LocalSettings

    monkeypatch.setenv("RLRUNBOOK_PEER_SHAPE", "2x2x4")
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPTS / "serve_bench.py")
    serve_bench = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts tests/benchmarks on it
    spec.loader.exec_module(serve_bench)
    with LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path)) as service:
        workload = serve_bench.Workload(service, "tiny", seed=0)
        groups = workload.sample()
        assert [len(group) for group in groups] == [2, 2]
        assert all(1 <= len(sequence.tokens) <= 4 for group in groups for sequence in group)
        assert workload.step() > 0 and workload.step_index == 1
