"""One process of the full-parameter training tests (``test_full_parameter.py`` starts 1, 2 or 4 of them).

Every rank builds the same eight datums (sampled from the initial ``tiny`` weights with a fixed seed) and
trains its contiguous share with a full-parameter client, float32 on CPU with one thread per process (the GPU
tier runs it on CUDA in bfloat16, ``--device``, ``--dtype``, ``--model``):

- ``straight``: two steps of forward_backward + optim_step; the gathered weights after them;
- ``resumed``: one step, the training state exported, a fresh client importing it, one more step: the
  gathered weights (must equal ``straight`` bit for bit);
- ``parity``: per step, the largest |trainer logprob - sampler logprob| of the rank's datums, sampled from the
  weights of that step (0: sampler = trainer);
- ``state_bytes``: per step, this rank's parameters, gradients and optimizer state after its forward_backward,
  the number of passes and the step's gradient norm;
- ``micro_batches``: with ``--micro-batch-tokens`` the ranks may split their shares into different numbers of
  passes (the idle passes keep the collectives matched).

``main`` writes the results of rank r to ``<argv[1]>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from tinker import types

from rlrunbook import distributed
from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.sharding import parameter_tensors
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11]
ADVANTAGES = [1.0, -2.0, 0.5, 0.25, -0.75, 1.5, -1.0, 0.5]
ADAM = types.AdamParams(learning_rate=1e-3)


def datum(completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    arrays = build_datum_arrays(PROMPT, completion, logprobs, [advantage] * len(completion))
    return types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                       loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                       "advantages": arrays.advantages})


def sample_data(client, seed: int) -> list[types.Datum]:
    """Eight datums sampled from the client's live weights (the same on every rank), lengths 3..8 tokens."""
    sampler = client.save_weights_and_get_sampling_client()
    data = []
    for index, advantage in enumerate(ADVANTAGES):
        params = types.SamplingParams(max_tokens=3 + index % 6, temperature=1.0, seed=seed + index, stop=[])
        sequence = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
        data.append(datum(list(sequence.tokens), list(sequence.logprobs), advantage))
    return data


def step(client, data: list[types.Datum], seed: int) -> tuple[float, dict]:
    """One RL step on this rank's share; the sampler-trainer gap of the share and the state bytes mid-step."""
    mine = distributed.shard(data)
    output = client.forward_backward(mine, "importance_sampling").result()
    gap = 0.0
    for datum_, out in zip(mine, output.loss_fn_outputs, strict=True):
        trainer = torch.tensor(out["logprobs"].data)
        sampler = torch.tensor(datum_.loss_fn_inputs["logprobs"].data)
        sampled = torch.tensor(datum_.loss_fn_inputs["advantages"].data) != 0
        gap = max(gap, float((trainer - sampler)[sampled].abs().max()))
    state = client.memory_bytes()
    grad_norm = client.optim_step(ADAM).result().metrics["grad_norm:mean"]
    return gap, {**state, "micro_batches": output.metrics["micro_batches:sum"], "grad_norm": grad_norm}


def run(micro_batch_tokens: int | None, device: str = "cpu", dtype: torch.dtype = torch.float32,
        model: str = "tiny") -> dict:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as storage:
        settings = LocalSettings(device=device, dtype=dtype, storage_dir=storage, micro_batch_tokens=micro_batch_tokens)
        with LocalServiceClient(settings) as service:
            client = service.create_full_training_client(model)
            initial = parameter_tensors(client._host.model)
            data = sample_data(client, seed=100)
            gaps, states = [], []
            for index in range(2):
                gap, state = step(client, data if index == 0 else sample_data(client, seed=200), index)
                gaps.append(gap)
                states.append(state)
            straight = parameter_tensors(client._host.model)

            first = service.create_full_training_client(model)
            step(first, data, 0)
            saved = first.export_training_state()
            second = service.create_full_training_client(model)
            second.import_training_state(saved)
            step(second, sample_data(second, seed=200), 1)
            resumed = parameter_tensors(second._host.model)
    rank = distributed.rank()
    return {"rank": rank, "world": distributed.world_size(), "parity": gaps, "state_bytes": states,
            "initial": initial if rank == 0 else None, "straight": straight if rank == 0 else None,
            "resumed": resumed if rank == 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="folder for rank<r>.pt")
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    results = run(args.micro_batch_tokens, args.device, getattr(torch, args.dtype), args.model)
    torch.save(results, f"{args.out}/rank{results['rank']}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main()
