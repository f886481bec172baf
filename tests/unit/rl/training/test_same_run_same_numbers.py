"""The same config run twice in one process gives the same numbers to the last bit, on 2 threads.

Shared prompts are read by many rows, so their gradients are sums over repeated indices. Indexing
with a tensor accumulates those in an order set by thread scheduling (two runs differed by ~1e-7 in
loss, mismatch and gradient norm from step 1 on); ``take_rows`` (``index_select``) adds in a fixed order.
"""

from __future__ import annotations

import json

import torch

from rlrunbook.engines.layouts import take_rows
from rlrunbook.rl import TrainConfig

TIMINGS = ("time/", "throughput/", "memory/")


def test_take_rows_is_indexing_with_a_deterministic_backward():
    torch.manual_seed(0)
    x = torch.randn(300, 576, requires_grad=True)
    index = torch.randint(0, 300, (50, 100))  # many repeats, as a shared prefix read by every row
    upstream = torch.randn(50, 100, 576)
    assert torch.equal(take_rows(x, index), x[index])
    grads = []
    with_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(10):
            x.grad = None
            take_rows(x, index).backward(upstream)
            grads.append(x.grad.clone())
    finally:
        torch.set_num_threads(with_threads)
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    expected = torch.zeros_like(x, dtype=torch.float64).index_add_(0, index.flatten(), upstream.reshape(-1, 576).double())
    assert torch.allclose(grads[0].double(), expected, atol=1e-5)


def test_two_identical_runs_in_one_process_log_identical_rows(tmp_path):
    from rlrunbook.rl import run_training

    with_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = []
        for name in ("first", "second"):
            config = TrainConfig(model="tiny", env="summary", num_rollouts=8, num_groups=2, steps=3, max_tokens=16,
                                 seed=0, log_root=str(tmp_path / name), name=name)
            run = run_training(config, log=lambda *_: None)
            rows.append([{k: v for k, v in json.loads(line).items() if not k.startswith(TIMINGS)}
                         for line in (run / "train_log.jsonl").read_text().splitlines()])
    finally:
        torch.set_num_threads(with_threads)
    assert len(rows[0]) == 3 and rows[0] == rows[1]
