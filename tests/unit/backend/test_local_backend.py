"""The local Tinker backend: training semantics, LoRA, sampler sync, ordering, futures, bad input."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch
from sdk_origin import assert_is_the_sdk
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings, backend_name, create_service_client
from rlrunbook.backend.lora import adapter_parameters
from rlrunbook.errors import ConfigError, InputError, NoLearningSignalError
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11]


def rl_datum(prompt, completion, logprobs, advantage):
    a = build_datum_arrays(prompt, completion, logprobs, [advantage] * len(completion))
    return types.Datum(model_input=types.ModelInput.from_ints(a.input_tokens),
                       loss_fn_inputs={"target_tokens": a.target_tokens, "logprobs": a.logprobs,
                                       "advantages": a.advantages})


def sample_group(sampler, n=4, max_tokens=8, seed=0):
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    return sampler.sample(types.ModelInput.from_ints(PROMPT), n, params).result().sequences


def group_datums(sequences, advantages):
    return [rl_datum(PROMPT, s.tokens, s.logprobs, a) for s, a in zip(sequences, advantages, strict=True)]


@pytest.fixture
def trainer_client(local_service):
    return local_service.create_lora_training_client("tiny", rank=4, seed=0)


def base_and_adapter(client):
    model = client._host.model
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in adapter_parameters(model).items()}
    return base, lora


def test_step_moves_adapter_not_base(trainer_client):
    sequences = sample_group(trainer_client.save_weights_and_get_sampling_client())
    base0, lora0 = base_and_adapter(trainer_client)
    out = trainer_client.forward_backward(group_datums(sequences, [1.0, -1.0, 0.5, -0.5]),
                                          "importance_sampling").result()
    assert out.metrics["num_trained_tokens:sum"] == 4 * 8
    assert "loss:sum" in out.metrics
    trainer_client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    base1, lora1 = base_and_adapter(trainer_client)
    assert all(torch.equal(base0[n], base1[n]) for n in base0), "a base weight moved"
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0), "no adapter weight moved"
    assert {n for n in lora0 if "lora_" not in n} == set(), "only LoRA parameters are trainable"


def test_zero_advantages_raise(trainer_client):
    sequences = sample_group(trainer_client.save_weights_and_get_sampling_client())
    with pytest.raises(NoLearningSignalError, match="No non-zero advantages"):
        trainer_client.forward_backward(group_datums(sequences, [0.0] * 4), "importance_sampling").result()


def test_returned_logprobs_match_sampler_before_training(trainer_client):
    sequences = sample_group(trainer_client.save_weights_and_get_sampling_client())
    out = trainer_client.forward(group_datums(sequences, [1.0] * 4), "importance_sampling").result()
    for s, record in zip(sequences, out.loss_fn_outputs, strict=True):
        learner = record["logprobs"].to_torch()[len(PROMPT) - 1:]
        assert torch.allclose(learner, torch.tensor(s.logprobs), atol=1e-4)
    # importance ratio is 1 at the sampled weights, so the IS loss is -sum(A) over sampled tokens
    assert out.metrics["loss:sum"] == pytest.approx(-4 * 8, abs=1e-3)


def _adapter_after(service, split: bool, chunks: int = 1):
    client = service.create_lora_training_client("tiny", rank=4, seed=0)
    client._trainer.grad_accum_chunks = chunks
    sequences = sample_group(client.save_weights_and_get_sampling_client(), n=4, seed=5)
    data = group_datums(sequences, [1.0, -2.0, 0.5, 0.25])
    if split:
        client.forward_backward(data[:1], "importance_sampling")
        client.forward_backward(data[1:], "importance_sampling")
    else:
        client.forward_backward(data, "importance_sampling")
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return {n: p.detach().clone() for n, p in adapter_parameters(client._host.model).items()}


def test_two_forward_backward_equal_one_over_union(local_service):
    together = _adapter_after(local_service, split=False)
    apart = _adapter_after(local_service, split=True)
    chunked = _adapter_after(local_service, split=False, chunks=3)
    for name in together:
        assert torch.allclose(together[name], apart[name], atol=1e-6), name
        assert torch.allclose(together[name], chunked[name], atol=1e-6), name
    moved = max((together[n] - apart[n]).abs().max() for n in together)
    assert moved < 1e-6


@pytest.mark.parametrize("chunks", [1, 3])
def test_gspo_takes_one_ratio_per_datum(local_service, chunks):
    """The trainer hands gspo each position's datum: the loss is -sum_i s_i sum_t A_t with s_i the datum's
    geometric-mean ratio over its sequence_ratio_mask, recomputed here from the returned logprobs."""
    client = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    client._trainer.grad_accum_chunks = chunks
    sequences = sample_group(client.save_weights_and_get_sampling_client(), n=3, seed=2)
    shifts = [0.7, 0.0, -0.4]  # datum i's sampler logprobs are off by shifts[i]: s_i = exp(-shift) if unmasked
    advantages = [1.0, -2.0, 0.5]
    data, masks = [], []
    for s, shift, advantage in zip(sequences, shifts, advantages, strict=True):
        datum = rl_datum(PROMPT, s.tokens, [lp + shift for lp in s.logprobs], advantage)
        mask = [0.0] * (len(PROMPT) - 1) + [1.0] * len(s.tokens)
        mask[-1] = 0.0  # the last sampled token is outside the ratio (and the loss)
        datum.loss_fn_inputs["sequence_ratio_mask"] = types.TensorData.from_torch(torch.tensor(mask))
        data.append(datum)
        masks.append(torch.tensor(mask, dtype=torch.bool))
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}
    out = client.forward(data, "gspo", wide).result()
    expected = 0.0
    for datum, record, mask, advantage in zip(data, out.loss_fn_outputs, masks, advantages, strict=True):
        lp = record["logprobs"].to_torch().double()[mask]
        q = datum.loss_fn_inputs["logprobs"].to_torch().double()[mask]
        expected -= torch.exp((lp - q).mean()).item() * advantage * int(mask.sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["ratio:mean"] == pytest.approx(
        sum(torch.exp(torch.tensor(-shift)).item() for shift in shifts) / 3, rel=1e-3)
    clipped = client.forward(data, "gspo").result()  # the paper's bounds: datums 0 and 2 clipped
    assert clipped.metrics["clip_fraction:mean"] == pytest.approx(2 / 3)


def test_sampler_sync_after_step(trainer_client):
    before = trainer_client.save_weights_and_get_sampling_client()
    sequences = sample_group(before)
    completion = list(sequences[0].tokens)
    full = types.ModelInput.from_ints(PROMPT + completion)
    lp_before = before.compute_logprobs(full).result()
    trainer_client.forward_backward(group_datums(sequences, [1.0, -1.0, 1.0, -1.0]), "importance_sampling")
    trainer_client.optim_step(types.AdamParams(learning_rate=1e-2))
    after = trainer_client.save_weights_and_get_sampling_client()
    lp_after = after.compute_logprobs(full).result()
    assert max(abs(a - b) for a, b in zip(lp_before[1:], lp_after[1:], strict=True)) > 1e-3
    # the old snapshot still samples the old weights
    assert before.compute_logprobs(full).result() == pytest.approx(lp_before, abs=1e-6)
    # and the new sampler agrees with the trainer's forward on the same tokens
    datum = rl_datum(PROMPT, completion, [0.0] * len(completion), 1.0)
    trainer_lp = trainer_client.forward([datum], "importance_sampling").result().loss_fn_outputs[0]["logprobs"]
    assert trainer_lp.to_torch().tolist() == pytest.approx(lp_after[1:], abs=1e-4)


def test_saved_sampler_weights_round_trip(trainer_client, local_service):
    sequences = sample_group(trainer_client.save_weights_and_get_sampling_client())
    trainer_client.forward_backward(group_datums(sequences, [1.0, -1.0, 1.0, -1.0]), "importance_sampling")
    trainer_client.optim_step(types.AdamParams(learning_rate=1e-2))
    saved = trainer_client.save_weights_for_sampler("step1").result()
    assert saved.path.startswith("tinker://") and saved.path.endswith("/sampler_weights/step1")
    live = trainer_client.save_weights_and_get_sampling_client()
    from_path = local_service.create_sampling_client(model_path=saved.path)
    full = types.ModelInput.from_ints(PROMPT + list(sequences[0].tokens))
    assert from_path.compute_logprobs(full).result() == pytest.approx(live.compute_logprobs(full).result(), abs=1e-5)
    fresh_service = LocalServiceClient(local_service.settings)  # another process would see only the folder
    try:
        cold = fresh_service.create_sampling_client(model_path=saved.path)
        assert cold.compute_logprobs(full).result() == pytest.approx(live.compute_logprobs(full).result(), abs=1e-5)
    finally:
        fresh_service.close()


def test_calls_take_effect_in_submission_order(trainer_client):
    sampler = trainer_client.save_weights_and_get_sampling_client()
    sequences = sample_group(sampler)
    full = types.ModelInput.from_ints(PROMPT + list(sequences[0].tokens))
    before = trainer_client.forward([rl_datum(PROMPT, list(sequences[0].tokens), [0.0] * 8, 1.0)], "importance_sampling")
    trainer_client.forward_backward(group_datums(sequences, [1.0, -1.0, 1.0, -1.0]), "importance_sampling")
    trainer_client.optim_step(types.AdamParams(learning_rate=1e-2))
    after = trainer_client.forward([rl_datum(PROMPT, list(sequences[0].tokens), [0.0] * 8, 1.0)], "importance_sampling")
    a = before.result().loss_fn_outputs[0]["logprobs"].to_torch()
    b = after.result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert (a - b).abs().max() > 1e-3, "the forward submitted after optim_step must see the new weights"
    assert sampler.compute_logprobs(full).result()[1] == pytest.approx(a[0].item(), abs=1e-4)


def test_futures_await_inside_running_loop(trainer_client):
    sampler = trainer_client.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)

    async def main():
        future = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params)
        awaited = await future
        blocking = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()  # also inside the loop
        legacy = await sampler.sample_async(types.ModelInput.from_ints(PROMPT), 2, params)
        return awaited, blocking, legacy

    awaited, blocking, legacy = asyncio.run(main())
    assert [s.tokens for s in awaited.sequences] == [s.tokens for s in blocking.sequences]
    assert [s.tokens for s in legacy.sequences] == [s.tokens for s in blocking.sequences]


def test_stop_none_keeps_eos_and_empty_list_disables_it(trainer_client):
    sampler = trainer_client.save_weights_and_get_sampling_client()
    eos = trainer_client._host.eos_token_ids[0]
    prompt = types.ModelInput.from_ints(PROMPT)
    free = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=30, seed=2, stop=[])).result()
    assert all(len(s.tokens) == 30 and s.stop_reason == "length" for s in free.sequences)
    first = free.sequences[0].tokens[4]
    stopped = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=30, seed=2, stop=[first])).result()
    assert stopped.sequences[0].tokens == free.sequences[0].tokens[:5]
    assert stopped.sequences[0].stop_reason == "stop"
    default = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=30, seed=2)).result()
    for s in default.sequences:
        assert s.stop_reason == "length" or s.tokens[-1] == eos


def test_prompt_logprobs(trainer_client):
    sampler = trainer_client.save_weights_and_get_sampling_client()
    response = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2),
                              include_prompt_logprobs=True).result()
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == len(PROMPT)
    assert response.prompt_logprobs[1:] == pytest.approx(
        sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:], abs=1e-6)


@pytest.mark.parametrize("make_data, loss, error, match", [
    (lambda s: group_datums(s, [1.0] * 4), "no_such_loss", ConfigError, "unknown loss_fn"),
    (lambda s: group_datums(s, [1.0] * 4), "stable_reinforce", ConfigError, "not supported by the local backend"),
    (lambda s: [], "importance_sampling", InputError, "empty batch"),
    (lambda s: [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0] * 3,
                                            "advantages": [1.0] * 3})],
     "importance_sampling", InputError, "unequal length"),
    (lambda s: [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10**7]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [0.0] * 3,
                                            "advantages": [1.0] * 3})],
     "importance_sampling", InputError, "outside the vocabulary"),
    (lambda s: [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4], "advantages": [1.0] * 3})],
     "importance_sampling", InputError, "logprobs"),
])
def test_bad_training_input_is_named(trainer_client, make_data, loss, error, match):
    sequences = sample_group(trainer_client.save_weights_and_get_sampling_client())
    with pytest.raises(error, match=match):
        trainer_client.forward_backward(make_data(sequences), loss).result()


@pytest.mark.parametrize("prompt, params, error, match", [
    ([], types.SamplingParams(max_tokens=4), InputError, "empty"),
    ([1, 10**7], types.SamplingParams(max_tokens=4), InputError, "outside the vocabulary"),
    (PROMPT, types.SamplingParams(max_tokens=0), ConfigError, "max_tokens"),
    (PROMPT, types.SamplingParams(max_tokens=-1), ConfigError, "max_tokens"),
    (PROMPT, types.SamplingParams.model_construct(max_tokens=4, stop=["\n", 5]), ConfigError, "stop strings"),
])
def test_bad_sampling_input_is_named(trainer_client, prompt, params, error, match):
    sampler = trainer_client.save_weights_and_get_sampling_client()
    with pytest.raises(error, match=match):
        sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()


def test_optim_step_without_gradients_is_an_error(trainer_client):
    with pytest.raises(InputError, match="forward_backward first"):
        trainer_client.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_backend_selection_keeps_the_sdk(monkeypatch):
    import tinker

    assert tinker.__name__ == "tinker" and hasattr(tinker, "ServiceClient")
    assert_is_the_sdk(tinker)
    assert backend_name({}) == "local"
    assert backend_name({"TINKER_BACKEND": "api"}) == "api"
    with pytest.raises(ConfigError, match="TINKER_BACKEND"):
        backend_name({"TINKER_BACKEND": "remote"})
    monkeypatch.setenv("TINKER_BACKEND", "local")
    monkeypatch.setenv("TINKER_LOCAL_DEVICE", "cpu")
    service = create_service_client()
    assert isinstance(service, LocalServiceClient)
    service.close()
    assert sys.modules["tinker"] is tinker


def test_settings_from_env():
    s = LocalSettings.from_env({"TINKER_LOCAL_GRAD_ACCUM_STEPS": "4", "TINKER_LOCAL_SEED": "7",
                                "TINKER_LOCAL_DEVICE": "cpu", "TINKER_LOCAL_DTYPE": "bf16"})
    assert (s.grad_accum_chunks, s.seed, s.device, s.resolved_dtype()) == (4, 7, "cpu", torch.bfloat16)
    assert LocalSettings.from_env({"TINKER_LOCAL_DEVICE": "cpu"}).resolved_dtype() == torch.float32
    with pytest.raises(ConfigError, match="TINKER_LOCAL_GRAD_ACCUM_STEPS"):
        LocalSettings.from_env({"TINKER_LOCAL_GRAD_ACCUM_STEPS": "0"})
    with pytest.raises(ConfigError, match="TINKER_LOCAL_DTYPE"):
        LocalSettings.from_env({"TINKER_LOCAL_DTYPE": "int8"})


def test_coded_weights_are_on_unless_turned_off():
    assert LocalSettings.from_env({}).coded_weights is True
    assert LocalSettings.from_env({"TINKER_LOCAL_CODED_WEIGHTS": "0"}).coded_weights is False
    with pytest.raises(ConfigError, match="TINKER_LOCAL_CODED_WEIGHTS='yes' must be 1"):
        LocalSettings.from_env({"TINKER_LOCAL_CODED_WEIGHTS": "yes"})
    from rlrunbook.backend.model_host import load_host, load_resident, share_weights
    from rlrunbook.engines.coded_forms import coded_forms

    for coded in (True, False):  # what the backend's engine is told (kernels/coded_weights.py)
        host = load_host("tiny", LocalSettings(device="cpu", dtype=torch.float32, coded_weights=coded))
        assert host.engine.decoder.coded_weights is coded
    resident = load_resident("tiny", LocalSettings(device="cpu", dtype=torch.float32))
    assert coded_forms(share_weights(resident)) is coded_forms(resident.model)  # one set over one loaded base


def test_concurrent_sample_requests_become_one_engine_call(trainer_client, local_service):
    """A round of requests submitted before waiting runs as one batch, and each gets what it would alone."""
    sampler = trainer_client.save_weights_and_get_sampling_client()
    prompts = [PROMPT, [7, 8, 9], [30, 31, 32, 33, 34, 35, 36], [12]]
    params = [types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, stop=[]) for i in range(4)]
    worker = local_service._worker
    before = worker.batches_run
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, sp) for p, sp in zip(prompts, params)]
    together = [f.result() for f in futures]
    assert worker.batches_run - before == 1
    alone = [sampler.sample(types.ModelInput.from_ints(p), 2, sp).result() for p, sp in zip(prompts, params)]
    assert worker.batches_run - before == 5
    assert [[s.tokens for s in r.sequences] for r in together] == [[s.tokens for s in r.sequences] for r in alone]


def test_unseeded_samples_follow_submission_order(local_service):
    """Without a seed, a process that makes the same calls gets the same samples (seeds drawn in order)."""
    def run():
        service = LocalServiceClient(local_service.settings)
        try:
            sampler = service.create_lora_training_client("tiny", rank=4).save_weights_and_get_sampling_client()
            params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
            first = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
            second = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
            return [s.tokens for s in first.sequences], [s.tokens for s in second.sequences]
        finally:
            service.close()

    a1, a2 = run()
    b1, b2 = run()
    assert (a1, a2) == (b1, b2)
    assert a1 != a2


def test_requests_submitted_in_a_batch_block_are_one_engine_call_whatever_the_timing(trainer_client, local_service):
    import time as _time

    sampler = trainer_client.save_weights_and_get_sampling_client()
    worker = local_service._worker
    before = worker.batches_run
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1, stop=[])
    with sampler.batch():
        futures = []
        for i in range(4):
            futures.append(sampler.sample(types.ModelInput.from_ints(PROMPT + [i + 3]), 1, params))
            _time.sleep(0.02)  # far longer than the coalescing window
    assert all(len(f.result().sequences) == 1 for f in futures)
    assert worker.batches_run - before == 1


def test_lora_wrapping_is_quiet_on_a_tied_model(smollm2_folder):
    """peft's tie_word_embeddings UserWarning and the is_gradient_checkpointing FutureWarning (both expected:
    see rlrunbook.backend.lora) never reach users; any other warning would."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from rlrunbook.backend.lora import wrap_with_lora

    config = AutoConfig.from_pretrained(smollm2_folder)
    assert config.tie_word_embeddings  # the case that makes peft warn
    small = AutoConfig.from_pretrained(smollm2_folder, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512)
    model = AutoModelForCausalLM.from_config(small)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = wrap_with_lora(model, rank=2, alpha=4, seed=0)
    assert [str(w.message) for w in caught] == []
    assert any("lm_head" in name and "lora_A" in name for name, _ in wrapped.named_parameters())
