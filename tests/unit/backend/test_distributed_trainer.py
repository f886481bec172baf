"""Data-parallel training at the trainer level: 2 gloo processes on halves = 1 process on the union.

``dp_trainer_worker.py`` runs as each of 2 ranks (subprocesses) while this process computes the
1-process reference with the same code. Losses are token sums, so the ranks' summed gradients are
the union's gradient. Two comparisons:

- against 1 process with the halves as two ``forward_backward`` calls (gradient accumulation):
  the same float32 additions (``g_a + g_b``), so the adapters must be bitwise equal;
- against 1 process on the union in one call: the batch is padded and summed differently, so
  float32 results differ in the last bits, and AdamW (eps 1e-12) turns the relative error of
  near-zero gradient entries into update differences of up to about 1e-4 * lr. After 2 steps
  at lr 1e-3 they must agree within ``TOLERANCE``.

The two ranks must end bitwise identical: they apply the same reduced gradient. Every process
computes with one thread (float32 matmul results depend on the thread count's blocking), which
is what makes the bitwise comparisons possible.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import dp_trainer_worker as worker
import pytest
import torch

from rlrunbook.testing import ranks

WORKER = Path(__file__).with_name("dp_trainer_worker.py")
# Largest |adapter(2 ranks) - adapter(1 process, union in one call)| after 2 AdamW steps at lr 1e-3.
# Measured 5.0e-8 (2-core CPU, float32, torch 2.13, 1 thread per process); 20x margin.
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{"single": reference results, "ranks": [rank 0 results, rank 1 results]}``."""
    from rlrunbook.backend import LocalServiceClient, LocalSettings

    tmp = tmp_path_factory.mktemp("dp_trainer")
    outs = [tmp / f"rank{rank}.pt" for rank in (0, 1)]
    procs = ranks.start([[sys.executable, str(WORKER), str(out)] for out in outs], ranks.rank_envs(2))
    try:
        with tempfile.TemporaryDirectory() as storage, \
                LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage)) as service:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): same float32 matmul blocking
            try:
                single = worker.run_scenarios(service)
            finally:
                torch.set_num_threads(threads)
    finally:
        done = ranks.finish(procs, timeout=240)
    for rank, result in enumerate(done):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return {"single": single, "ranks": [torch.load(out, weights_only=False) for out in outs]}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.slow
def test_the_ranks_ran_as_a_group_of_two(runs):
    assert [r["rank"] for r in runs["ranks"]] == [0, 1]
    assert {r["world_size"] for r in runs["ranks"]} == {2}
    assert runs["single"]["world_size"] == 1


def test_two_ranks_equal_one_process_accumulating_the_same_halves(runs):
    for ranked in runs["ranks"]:
        assert _max_diff(runs["single"]["accumulated"], ranked["union"]) == 0.0


def test_two_ranks_on_halves_match_one_process_on_the_union(runs):
    single = runs["single"]
    for ranked in runs["ranks"]:
        assert _max_diff(single["initial"], ranked["initial"]) == 0.0, "ranks must start from the same adapter"
        assert _max_diff(single["initial"], ranked["union"]) > 100 * TOLERANCE, "the adapter did not move"
        diff = _max_diff(single["union"], ranked["union"])
        assert diff <= TOLERANCE, f"2-rank adapter differs from 1-process adapter by {diff:.2e}"


def test_ranks_end_bitwise_identical(runs):
    rank0, rank1 = runs["ranks"]
    for key in ("union", "rank0_only"):
        assert _max_diff(rank0[key], rank1[key]) == 0.0, key


def test_reported_grad_norm_and_loss_are_the_global_ones(runs):
    single = runs["single"]["union_metrics"]
    for ranked in runs["ranks"]:
        for one, two in zip(single, ranked["union_metrics"], strict=True):
            assert two["grad_norm:mean"] == pytest.approx(one["grad_norm:mean"], rel=1e-5)
            assert two["loss:sum"] == pytest.approx(one["loss:sum"], rel=1e-5, abs=1e-4)


def test_a_rank_without_data_joins_the_step(runs):
    single = runs["single"]
    for ranked in runs["ranks"]:
        diff = _max_diff(single["rank0_only"], ranked["rank0_only"])
        assert diff <= TOLERANCE, f"rank {ranked['rank']}: {diff:.2e}"
        assert ranked["rank0_only_metrics"][0]["grad_norm:mean"] == pytest.approx(
            single["rank0_only_metrics"][0]["grad_norm:mean"], rel=1e-5)


def test_a_nan_on_one_rank_refuses_the_step_on_every_rank(runs):
    for result in [runs["single"], *runs["ranks"]]:
        assert result["nan_error"] == "NonFiniteGradientError", result["rank"]
        assert result["nan_unchanged"], f"rank {result['rank']} moved its weights on a NaN gradient"
