"""The peer workload's rlrunbook step with the sampler's kept products read by the trainer, and without.

Steps of one process alternate between keeping them (the default, ``TINKER_LOCAL_KEPT_PRODUCTS_MB``) and not
(a budget of 0), so both see the same machine state. Reported in ``extra_info``: each side's median seconds per
step and its phase split, the median of the paired differences (on - off, one pair per two steps), the decode
milliseconds per step of each side (keeping writes the products next to the outputs), and the tokens each side's
``forward_backward`` read instead of computing. The test fails where keeping did not take effect (no token read
with it on, or one read with it off): a timing without the mechanism would mean nothing.

    pytest -m benchmark tests/benchmarks/test_bench_kept_products.py --benchmark-enable -s

``RLRUNBOOK_PEER_STEPS`` (default 4) timed pairs, after a warm-up pair; ``RLRUNBOOK_PEER_SHAPE`` the workload shape.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from bench_support import bench_device, describe
from peer_workload import RlrunbookPeer, Timings, peer_shape

pytestmark = pytest.mark.benchmark(group="kept-products")


def test_peer_step_with_and_without_kept_products(benchmark, tmp_path):
    device = bench_device()
    if device != "cpu":
        pytest.skip("the sampler keeps products on CPU only (engines/kept_products.py)")
    pairs = int(os.environ.get("RLRUNBOOK_PEER_STEPS", "4"))
    peer = RlrunbookPeer(device, torch.float32, tmp_path / "tinker", peer_shape())
    engine = peer.engine
    budget = engine.kept_products_bytes
    assert budget > 0, "keeping is off (TINKER_LOCAL_KEPT_PRODUCTS_MB=0): nothing to compare"
    sides = {"on": Timings(), "off": Timings()}
    decode = {"on": [], "off": []}
    read = {"on": [], "off": []}
    trainer = peer.training._trainer
    original = trainer.forward_backward
    now = {"side": "on"}

    def counted(data, loss_fn, loss_fn_config=None):
        output = original(data, loss_fn, loss_fn_config)
        read[now["side"]].append(output.metrics["kept_product_tokens:sum"])
        return output

    trainer.forward_backward = counted

    def run() -> None:
        for index in range(1 + pairs):
            for side in (("on", "off") if index % 2 else ("off", "on")):
                now["side"] = side
                engine.kept_products_bytes = budget if side == "on" else 0
                engine.kept = None
                peer.timings = sides[side]
                seconds, steps = engine.decode_seconds, engine.decode_steps
                peer.step()
                decode[side].append(1000 * (engine.decode_seconds - seconds) / max(1, engine.decode_steps - steps))

    benchmark.pedantic(run, rounds=1, iterations=1)
    assert all(count > 0 for count in read["on"]) and not any(read["off"]), read
    on, off = sides["on"].steps[1:], sides["off"].steps[1:]  # the first pair warms up
    figures = {
        "shape": str(peer.shape),
        "on_s_per_step": round(statistics.median(on), 3),
        "off_s_per_step": round(statistics.median(off), 3),
        "paired_difference_s": round(statistics.median(a - b for a, b in zip(on, off, strict=True)), 3),
        "on_phases_s": {k: round(v, 3) for k, v in sides["on"].phase_medians(1).items()},
        "off_phases_s": {k: round(v, 3) for k, v in sides["off"].phase_medians(1).items()},
        "on_decode_ms_per_step": round(statistics.median(decode["on"][1:]), 2),
        "off_decode_ms_per_step": round(statistics.median(decode["off"][1:]), 2),
        "kept_product_tokens_per_step": statistics.median(read["on"]),
        **describe(device, torch.float32),
    }
    benchmark.extra_info.update(figures)
    print(json.dumps(figures, indent=1))
    peer.close()
