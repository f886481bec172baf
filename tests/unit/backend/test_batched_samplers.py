"""Samplers of several training clients of one base model, sampling at once, decode as one batch with an adapter per
row: each request gets exactly what it gets alone, and samplers of another LoRA layout are batched apart."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11, 300, 7]
PARAMS = types.SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop=[9])


@pytest.fixture
def service(tmp_path):
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker"))
    yield service
    service.close()


def _trained_sampler(service: LocalServiceClient, rank: int, seed: int):
    """A sampler of a training client moved one step away from its zero-B start (its own data and seed)."""
    training = service.create_lora_training_client("tiny", rank=rank, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 300, (12,), generator=generator).tolist()
    arrays = build_datum_arrays(tokens[:4], tokens[4:], [-1.0] * 8, [1.0] * 8)
    datum = types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                        loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                        "advantages": arrays.advantages})
    training.forward_backward([datum], "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return training.save_weights_and_get_sampling_client()


def _submit(sampler, prompt_logprobs: bool = False):
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 3, PARAMS, include_prompt_logprobs=prompt_logprobs)


def _outcome(response) -> tuple:
    lps = None if response.prompt_logprobs is None else [str(v) for v in response.prompt_logprobs]
    return [(list(s.tokens), list(s.logprobs), s.stop_reason) for s in response.sequences], lps


def test_samplers_of_several_clients_decode_as_one_batch_and_get_what_they_get_alone(service):
    samplers = [_trained_sampler(service, 4, seed) for seed in (1, 2, 3)]
    other_layout = _trained_sampler(service, 8, 4)
    asks = [(samplers[0], True), (samplers[1], False), (samplers[2], False), (other_layout, False),
            (samplers[0], False)]
    alone = [_outcome(_submit(sampler, want).result(timeout=120)) for sampler, want in asks]
    assert len({str(outcome[0]) for outcome in alone[:4]}) == 4  # every adapter samples differently
    worker = service._worker
    before = worker.batches_run
    with samplers[0].batch():  # submitted before the worker takes any
        futures = [_submit(sampler, want) for sampler, want in asks]
    together = [_outcome(future.result(timeout=120)) for future in futures]
    assert together == alone
    # the three rank-4 samplers' four requests as one batch, the rank-8 one apart
    assert worker.batches_run - before == 2
