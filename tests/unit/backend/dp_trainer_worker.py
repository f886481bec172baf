"""One rank of the trainer-level data-parallel test (``test_distributed_trainer.py`` starts two).

Every rank builds the same datums (tiny, fixed seeds); :func:`run_scenarios` trains its share and
returns what it observed; ``main`` writes that to ``argv[1]``. The test also calls
:func:`run_scenarios` in its own process, where no process group exists: the 1-process reference.

- ``union``: 1 process: all 8 datums in one forward_backward; under DP: this rank's contiguous half;
- ``accumulated``: halves as separate forward_backward calls (1 process only: DP's arithmetic);
- ``rank0_only``: rank 0 trains all datums, the other ranks none (they only join optim_step);
- ``nan``: the last rank's datum has a NaN advantage; every rank must refuse the step.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from tinker import types

from rlrunbook import distributed
from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.lora import adapter_parameters
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11]
ADVANTAGES = [1.0, -2.0, 0.5, 0.25, -0.75, 1.5, -1.0, 0.5]
ADAM = types.AdamParams(learning_rate=1e-3)
STEPS = 2


def datum(completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    arrays = build_datum_arrays(PROMPT, completion, logprobs, [advantage] * len(completion))
    return types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                       loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                       "advantages": arrays.advantages})


def adapter(client) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in adapter_parameters(client._host.model).items()}


def new_client_and_data(service, advantages: list[float]):
    """A fresh LoRA client (same seed on every rank) and datums sampled from it (same on every rank)."""
    client = service.create_lora_training_client("tiny", rank=4, seed=0)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    sequences = client.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(PROMPT), len(advantages), params).result().sequences
    data = [datum(list(s.tokens), list(s.logprobs), a) for s, a in zip(sequences, advantages, strict=True)]
    return client, data


def train(client, parts: list[list[types.Datum]], steps: int) -> list[dict[str, float]]:
    """``steps`` rounds of one forward_backward per non-empty part, then optim_step (always)."""
    metrics = []
    for _ in range(steps):
        for part in parts:
            if part:
                client.forward_backward(part, "importance_sampling")
        metrics.append(dict(client.optim_step(ADAM).result().metrics))
    return metrics


def run_scenarios(service) -> dict:
    """Every scenario on fresh LoRA clients of ``service``; adapters and metrics by scenario name."""
    rank, world = distributed.rank(), distributed.world_size()
    results: dict = {"rank": rank, "world_size": world}
    client, data = new_client_and_data(service, ADVANTAGES)
    results["initial"] = adapter(client)
    results["union_metrics"] = train(client, [distributed.shard(data)], steps=STEPS)
    results["union"] = adapter(client)
    if world == 1:
        client, data = new_client_and_data(service, ADVANTAGES)
        results["accumulated_metrics"] = train(client, [distributed.shard(data, r, 2) for r in (0, 1)], steps=STEPS)
        results["accumulated"] = adapter(client)

    client, data = new_client_and_data(service, ADVANTAGES)
    results["rank0_only_metrics"] = train(client, [data if rank == 0 else []], steps=1)
    results["rank0_only"] = adapter(client)

    client, data = new_client_and_data(service, [1.0] * (world - 1) + [float("nan")])
    before = adapter(client)
    try:
        train(client, [distributed.shard(data)], steps=1)
        results["nan_error"] = None
    except Exception as error:  # noqa: BLE001 - whatever it is, the test judges its type
        results["nan_error"] = type(error).__name__
    results["nan_unchanged"] = all(torch.equal(before[n], p) for n, p in adapter(client).items())
    return results


def main(out_path: str) -> None:
    distributed.init(device="cpu")
    with tempfile.TemporaryDirectory() as storage, \
            LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage)) as service:
        torch.save(run_scenarios(service), out_path)


if __name__ == "__main__":
    main(sys.argv[1])
