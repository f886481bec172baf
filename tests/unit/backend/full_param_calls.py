"""One process of the test of full-parameter calls made at awkward points (``test_full_parameter.py``).

Under 2 ranks (or 1 process) with a 12-token micro-batch budget, so that the ranks' shares split into different
numbers of passes, it makes, in order:

- ``forward_backward_custom`` with rank 0 holding 7 datums and rank 1 none (it joins with an empty list);
- ``forward`` on every rank, then sampling on rank 0 alone (the weights must be back in place without a
  collective), scored by a ``forward`` every rank joins;
- in one process only: sampling between ``forward_backward`` and ``optim_step``, then the step, then a new
  sampler, whose logprobs must be the trainer's (0 gap);
- ``kl_coef`` on a client made without the reference: a ConfigError naming ``with_reference=True``.

``main`` writes what it saw to ``<argv[1]>/rank<r>.pt``.
"""

from __future__ import annotations

import sys
import tempfile

import full_param_worker as worker
import torch
from tinker import types

from rlrunbook import distributed
from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.errors import ConfigError


def gap(data: list[types.Datum], output: types.ForwardBackwardOutput) -> float:
    """Largest |trainer - sampler| logprob over the sampled positions of ``data``."""
    worst = 0.0
    for datum, out in zip(data, output.loss_fn_outputs, strict=True):
        sampled = torch.tensor(datum.loss_fn_inputs["advantages"].data) != 0
        diff = torch.tensor(out["logprobs"].data) - torch.tensor(datum.loss_fn_inputs["logprobs"].data)
        worst = max(worst, float(diff[sampled].abs().max()))
    return worst


def run() -> dict:
    torch.manual_seed(0)
    seen = {}
    with tempfile.TemporaryDirectory() as storage, LocalServiceClient(LocalSettings(
            device="cpu", dtype=torch.float32, storage_dir=storage, micro_batch_tokens=12)) as service:
        client = service.create_full_training_client("tiny")  # joins torchrun's group
        rank = distributed.rank()
        data = worker.sample_data(client, seed=100)
        mine = data[:7] if rank == 0 or distributed.world_size() == 1 else []
        total = lambda _, logprobs: (sum((-lp).sum() for lp in logprobs), {})  # noqa: E731
        seen["custom_passes"] = client.forward_backward_custom(mine, total).result().metrics["micro_batches:sum"]
        seen["custom_grad_norm"] = client.optim_step(worker.ADAM).result().metrics["grad_norm:mean"]

        client.forward(distributed.shard(data), "importance_sampling").result()
        fresh = worker.sample_data(client, seed=300) if rank == 0 else []  # rank 0 alone: no collective allowed
        scored = client.forward(fresh, "importance_sampling").result()  # every rank (rank 1 joins with none)
        if rank == 0:
            seen["gap_after_forward"] = gap(fresh, scored)

        if distributed.world_size() == 1:
            client.forward_backward(data, "importance_sampling").result()
            worker.sample_data(client, seed=400)  # between forward_backward and optim_step
            client.optim_step(worker.ADAM).result()
            fresh = worker.sample_data(client, seed=500)
            seen["gap_after_mid_step_sampling"] = gap(fresh, client.forward(fresh, "importance_sampling").result())
            try:
                client.forward_backward(data, "importance_sampling", {"kl_coef": 0.1}).result()
            except ConfigError as error:
                seen["kl_without_reference"] = str(error)
    return {"rank": rank, **seen}


def main() -> None:
    results = run()
    torch.save(results, f"{sys.argv[1]}/rank{results['rank']}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main()
