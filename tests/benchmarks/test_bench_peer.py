"""rlrunbook's whole RL step against TRL's GRPOTrainer on the peer workload, in one process.

See peer_workload.py for the workload and the interleaving. Reported in ``extra_info`` (and so in
``--benchmark-json``): each side's median seconds per step after a warm-up step, the ratio
rlrunbook / TRL, rlrunbook's phase split (sample / score / forward_backward / optimizer) and decode
steps, TRL's seconds inside ``generate``, and both warm-ups (first step). The gate is per device
(rlrunbook.testing.bench_gates.peer_failures): on CUDA the target, rlrunbook's step at most 0.25x TRL's; and the
ratio within 15% of the one stored for this device and model (``baselines.json``) where one is stored, which a
device without a target must have (a CPU run without its key fails, saying how to store it). Also reported: rlrunbook's steps timed before TRL first runs in the process
(``rlrunbook_alone_s_per_step``), a check that TRL's presence costs rlrunbook nothing (it used to: see
rlrunbook/backend/openmp.py). Never absolute times: they swing 2x on shared cores, the ratio measured in
one run does not.

    pytest -m benchmark tests/benchmarks/test_bench_peer.py --benchmark-enable --benchmark-json=peer.json
    RLRUNBOOK_UPDATE_BENCH_BASELINE=1 pytest -m benchmark ... # store this run's ratio as the baseline

Needs the ``bench`` extra (trl): without it the test skips with one reason line, and fails under
``RLRUNBOOK_REQUIRE_TRL=1`` (the ``trl`` marker; rlrunbook/testing/trl.py). The decode, RL-step and training
benchmarks need no TRL and run regardless. ``RLRUNBOOK_PEER_STEPS`` (default 4) timed steps per side;
``RLRUNBOOK_PEER_SHAPE`` another workload shape (peer_workload.py; its baseline is kept apart).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from bench_support import baselines, bench_device, describe, store_baseline, synchronize, updating_baselines
from peer_workload import (
    GenerateTimer,
    PeerShape,
    RlrunbookPeer,
    Timings,
    peer_model,
    peer_shape,
    trl_trainer,
)

from rlrunbook.testing.bench_gates import baseline_device, peer_failures

pytestmark = [pytest.mark.benchmark(group="peer"), pytest.mark.trl]

WARMUP = 1
ALONE = 2  # rlrunbook steps timed before TRL starts (after a warm-up of their own)


def _baseline_key(device: str, shape: PeerShape) -> str:
    key = f"peer/{baseline_device(device)}/{peer_model()}"
    return key if shape == PeerShape() else f"{key}/{shape}"


def test_rl_step_against_trl(benchmark, tmp_path):
    from transformers import TrainerCallback  # TRL itself is checked by the ``trl`` marker (conftest.py)

    device = bench_device()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    steps = int(os.environ.get("RLRUNBOOK_PEER_STEPS", "4"))
    shape = peer_shape()
    ours = RlrunbookPeer(device, dtype, tmp_path / "tinker", shape)
    # rlrunbook's steps before TRL has run in this process. They once ran ~40% faster than the interleaved
    # ones: TRL's OpenMP thread pool on this thread throttled the backend's (fixed in backend/openmp.py).
    for _ in range(WARMUP + ALONE):
        ours.step()
    alone = ours.timings
    engine = ours.engine
    decode_before = (getattr(engine, "decode_seconds", 0.0), getattr(engine, "decode_steps", 0))
    ours.timings = Timings()
    theirs = Timings()
    timer = GenerateTimer()

    class Interleave(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.started, self.generating = time.perf_counter(), timer.seconds

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            theirs.add(time.perf_counter() - self.started, sample=timer.seconds - self.generating)
            ours.step()

    trainer = trl_trainer(device, dtype, WARMUP + steps, [Interleave()], str(tmp_path / "trl"), shape)
    with timer:
        benchmark.pedantic(trainer.train, rounds=1, iterations=1)
    ours.close()
    assert len(theirs.steps) == len(ours.timings.steps) == WARMUP + steps
    ratio = ours.timings.median(WARMUP) / theirs.median(WARMUP)
    decode_seconds = getattr(engine, "decode_seconds", 0.0) - decode_before[0]
    decode_steps = getattr(engine, "decode_steps", 0) - decode_before[1]
    info = {
        "model": peer_model(), "shape": str(shape), "rlrunbook_s_per_step": round(ours.timings.median(WARMUP), 3),
        "trl_s_per_step": round(theirs.median(WARMUP), 3), "ratio_rlrunbook_over_trl": round(ratio, 3),
        "rlrunbook_warmup_s": round(ours.timings.steps[0], 3), "trl_warmup_s": round(theirs.steps[0], 3),
        **{f"rlrunbook_{k}_s": round(v, 3) for k, v in ours.timings.phase_medians(WARMUP).items()},
        "trl_generate_s": round(theirs.phase_medians(WARMUP)["sample"], 3),
        "rlrunbook_decode_ms_per_step": round(1e3 * decode_seconds / max(1, decode_steps), 2)
        if hasattr(engine, "decode_steps") else None,
        "rlrunbook_prefill_tokens_per_step": engine.prefill_tokens // (len(ours.timings.steps) + len(alone.steps))
        if hasattr(engine, "prefill_tokens") else None,
        "rlrunbook_alone_s_per_step": round(alone.median(WARMUP), 3),
        "ratio_alone_over_trl": round(alone.median(WARMUP) / theirs.median(WARMUP), 3),
        **describe(device, dtype),
    }
    benchmark.extra_info.update(info)
    print(json.dumps(info, indent=1))
    key = _baseline_key(device, shape)
    if updating_baselines():
        store_baseline(key, {"ratio": round(ratio, 3), "steps": steps}, device)
        return
    failures = peer_failures(device, key, ratio, baselines().get(key))
    assert not failures, "\n".join(failures)
