"""``rlrunbook serve``: the unmodified Tinker SDK drives the local backend over HTTP, with the same numbers.

One server subprocess (built-in model ``tiny``, a temporary storage, a key) serves the module's tests, which
reach it only through ``tinker.ServiceClient(base_url=...)``; plain HTTP is used only for what the SDK cannot
send (no key, a hostile body). The wire codecs are checked against the SDK's own converters without a server.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import request_conv, response_conv

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.errors import InputError
from rlrunbook.service.futures import SeqOrder
from rlrunbook.service.wire import (
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)
from rlrunbook.testing.commands import installed_rlrunbook

SRC = Path(__file__).resolve().parents[3] / "src"
KEY = "tml-serve-test-key"
READY = re.compile(r"TINKER_BASE_URL=(\S+)")
MAX_BODY_MIB = 2


def _env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout's ``src`` first, telemetry off."""
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "TINKER_TELEMETRY": "0", **extra}


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([installed_rlrunbook(), "serve", *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of a server on a free port, with a key and a 2 MiB body limit."""
    storage = tmp_path_factory.mktemp("serve-storage")
    process = _serve("--port", "0", "--storage", str(storage), "--api-key", KEY, "--max-body-mib", str(MAX_BODY_MIB))
    try:
        line = process.stdout.readline()  # the ready line, or nothing once the process died
        match = READY.search(line)
        if match is None:
            process.kill()
            pytest.fail(f"rlrunbook serve did not start: {line!r} {process.communicate(timeout=30)[1][-2000:]}")
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture()
def service(server, monkeypatch):
    """A ServiceClient of the server, as a user makes it."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    client = tinker.ServiceClient(base_url=server, api_key=KEY)
    yield client
    client.close("success").result()


def _datum(tokens: list[int], targets: list[int], weights: list[float]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=targets, dtype="int64"),
                                       "weights": types.TensorData(data=weights, dtype="float32")})


DATA = [_datum([1, 2, 3, 4], [2, 3, 4, 5], [0.0, 1.0, 1.0, 1.0]), _datum([7, 8, 9], [8, 9, 10], [1.0, 0.5, 1.0])]
PROMPT = types.ModelInput.from_ints([3, 1, 4, 1, 5])
PARAMS = types.SamplingParams(max_tokens=5, seed=11, temperature=1.0)


# -- the wire codecs against the SDK's own converters (no server) -----------------------------------------------
def test_forward_backward_request_decodes_what_the_sdk_encodes():
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=DATA, loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.8, "mode": "x"}),
        model_id="s:train:0", seq_id=7)
    call = decode_forward_backward(request_conv.forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8), "mode": "x"}
    for got, sent in zip(call.data, DATA, strict=True):
        assert got.model_input.to_ints() == sent.model_input.to_ints()
        for name, value in sent.loss_fn_inputs.items():
            assert got.loss_fn_inputs[name].dtype == value.dtype
            assert torch.equal(got.loss_fn_inputs[name].to_torch(), value.to_torch())


def test_an_image_chunk_is_the_callers_error_naming_it():
    """What the cookbook's image classifier sends over HTTP (an ImageChunk in a datum) is refused as the caller's
    error naming the chunk, before any model sees it (in process, ``rlrunbook cookbook`` refuses the recipe)."""
    image = types.ImageChunk(data=b"\x89PNG\r\n", format="png", expected_tokens=4)
    datum = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), image]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4, 5, 6, 7], dtype="int64",
                                                                          shape=[6])})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[DATA[0], datum], loss_fn="cross_entropy"),
        model_id="s:train:0", seq_id=1)
    with pytest.raises(InputError, match="datum 1: a image model_input chunk; .* token chunks"):
        decode_forward_backward(request_conv.forward_backward_request_to_proto(request).SerializeToString())


def test_forward_backward_output_encodes_what_the_sdk_decodes():
    logprobs = [np.array([-1.5, -0.25], np.float32), np.array([-3.0], np.float32)]
    output = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 4.75, "grad:mean": 1 / 3},
        loss_fn_outputs=[{"logprobs": types.TensorData.from_numpy(array)} for array in logprobs])
    decoded = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(output))
    assert decoded.metrics == output.metrics
    for got, sent in zip(decoded.loss_fn_outputs, logprobs, strict=True):
        assert np.array_equal(got["logprobs"].to_numpy(), sent)


def _sequence(stop_reason: str, tokens: list[int], logprobs: list[float]) -> types.SampledSequence:
    return types.SampledSequence(stop_reason=stop_reason, sequence_id="s", tokens_np=np.array(tokens, np.int32),
                                 logprobs_np=np.array(logprobs, np.float32))


def test_sample_response_encodes_what_the_sdk_decodes():
    response = types.SampleResponse(
        sequences=[_sequence("stop", [5, 2], [-0.125, -7.5]),
                   _sequence("length", [9], [-1.0])],
        prompt_logprobs_np=np.array([np.nan, -2.5, -0.5], np.float32))
    decoded = response_conv.deserialize_sample_response(encode_sample_response(response))
    assert [(s.stop_reason, s.tokens, s.logprobs) for s in decoded.sequences] == [
        ("stop", [5, 2], [-0.125, -7.5]), ("length", [9], [-1.0])]
    assert decoded.prompt_logprobs == [None, -2.5, -0.5]


def test_seq_order_runs_calls_in_seq_id_order_whatever_the_arrival():
    order, ran = SeqOrder("test"), []
    futures = {seq: order.submit(seq, lambda seq=seq: ran.append(seq) or seq) for seq in (3, 2, 1)}
    assert [futures[seq].result(timeout=10) for seq in (1, 2, 3)] == [1, 2, 3]
    assert ran == [1, 2, 3]
    with pytest.raises(ValueError, match="seq_id 2 of this model was already used"):
        order.submit(2, lambda: None).result(timeout=10)
    order.close()


# -- over the wire -----------------------------------------------------------------------------------------------
def test_main_flow_over_the_wire(service, server):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    assert training.get_info().model_data.model_name == "tiny"
    output = training.forward_backward(DATA, "cross_entropy").result()
    assert output.metrics["loss:sum"] > 0 and len(output.loss_fn_outputs) == len(DATA)
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["learning_rate:mean"] == 1e-2
    saved = training.save_weights_for_sampler("flow").result().path
    state = training.save_state("flow-state").result().path
    assert saved.startswith("tinker://") and state.startswith("tinker://")
    sampler = service.create_sampling_client(model_path=saved).result()
    result = sampler.sample(PROMPT, 2, PARAMS).result()
    assert [len(sequence.tokens) for sequence in result.sequences] == [5, 5]
    snapshot = training.save_weights_and_get_sampling_client().result()
    assert snapshot.sample(PROMPT, 2, PARAMS).result().sequences[0].tokens == result.sequences[0].tokens
    restored = service.create_training_client_from_state_with_optimizer(state).result()
    again = restored.forward(DATA, "cross_entropy").result()
    after = training.forward(DATA, "cross_entropy").result()
    assert again.metrics["loss:sum"] == after.metrics["loss:sum"]  # the restored adapter is the saved one
    runs = tinker.RestClient(base_url=server, api_key=KEY).list_training_runs().result().training_runs
    assert len(runs) >= 2


def test_over_the_wire_equals_in_process_bit_for_bit(service, tmp_path):
    local = LocalServiceClient(LocalSettings.from_env({**os.environ, "TINKER_LOCAL_STORAGE": str(tmp_path)}))
    try:
        results = [_steps(client) for client in (service, local)]
    finally:
        local.close()
    wire, here = results
    for name in ("loss", "loss_after"):
        assert wire[name] == here[name], name
    for got, want in zip(wire["logprobs"], here["logprobs"], strict=True):
        assert torch.equal(got, want)
    assert wire["step"] == here["step"]
    assert wire["samples"] == here["samples"]
    assert wire["prompt_logprobs"] == here["prompt_logprobs"]


def _steps(service) -> dict:
    """The same calls on either ServiceClient: a step, the loss after it, a snapshot's samples and logprobs."""
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    first = training.forward_backward(DATA, "cross_entropy").result()
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward(DATA, "cross_entropy").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    samples = sampler.sample(PROMPT, 3, PARAMS).result()
    return {"loss": first.metrics["loss:sum"], "loss_after": after.metrics["loss:sum"],
            "logprobs": [output["logprobs"].to_torch() for output in first.loss_fn_outputs],
            "step": step.metrics,
            "samples": [(s.tokens, s.logprobs, s.stop_reason) for s in samples.sequences],
            "prompt_logprobs": sampler.compute_logprobs(PROMPT).result()}


def test_a_wrong_key_is_refused_and_healthz_is_open(server, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    intruder = tinker.ServiceClient(base_url=server, api_key="tml-not-the-key")
    with pytest.raises(tinker.AuthenticationError, match="a wrong X-API-Key"):
        intruder.create_lora_training_client(base_model="tiny", rank=4).result()
    # The SDK never sends a request without a key: plain HTTP checks that case.
    missing = httpx.post(f"{server}/api/v1/create_session", json={"tags": [], "user_metadata": {}})
    assert missing.status_code == 401 and "no X-API-Key header" in missing.json()["detail"]
    assert httpx.get(f"{server}/api/v1/healthz").json() == {"status": "ok"}


def test_a_route_not_served_is_not_found_naming_it(server):
    answer = httpx.post(f"{server}/api/v1/no_such_route", content=b"{}", headers={"X-API-Key": KEY})
    assert answer.status_code == 404
    assert answer.json()["detail"].startswith("rlrunbook serve does not implement POST /api/v1/no_such_route")


def test_a_failing_call_names_the_cause_and_the_server_goes_on(service, server):
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'no-such-loss'"):
        training.forward_backward(DATA, "no-such-loss").result()
    assert training.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"] > 0
    # Hostile bodies, which the SDK never sends: a 4xx naming the cause, never a 500.
    headers = {"X-API-Key": KEY}
    garbage = httpx.post(f"{server}/api/v1/forward_backward", content=b"\xff" * 64, headers=headers)
    assert garbage.status_code == 400 and "not a tinker_public.ForwardBackwardRequest" in garbage.text
    wrong_type = httpx.post(f"{server}/api/v1/optim_step", json={"model_id": 5, "seq_id": "x"}, headers=headers)
    assert wrong_type.status_code == 400 and "not a OptimStepRequest" in wrong_type.text
    nan = [_datum([1, 2], [2, 3], [1.0, math.nan])]
    with pytest.raises(tinker.BadRequestError, match="holds NaN"):
        service.create_lora_training_client(base_model="tiny", rank=4).result().forward_backward(
            nan, "cross_entropy").result()
    huge = httpx.post(f"{server}/api/v1/forward_backward", content=b"\0" * (MAX_BODY_MIB * 2**20 + 1),
                      headers=headers)
    assert huge.status_code == 413 and "exceeds this server's limit" in huge.text
    chunks = (b"\0" * 2**20 for _ in range(MAX_BODY_MIB + 1))  # no Content-Length: counted as it arrives
    chunked = httpx.post(f"{server}/api/v1/forward_backward", content=chunks, headers=headers)
    assert chunked.status_code == 413 and "exceeds this server's limit" in chunked.text
    too_long = [_datum([5] * 2049, [6] * 2049, [1.0] * 2049)]  # tiny's context is 2,048 positions
    with pytest.raises(tinker.RequestFailedError, match="2049 tokens, more than this model's context of 2048"):
        training.forward_backward(too_long, "cross_entropy").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="num_samples=1000000000 is above"):
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 10**9, types.SamplingParams(max_tokens=2)).result()
    assert training.forward(DATA, "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_network_address_without_a_key_is_refused_at_start():
    process = subprocess.run([installed_rlrunbook(), "serve", "--host", "0.0.0.0", "--port", "0"],
                             env={**_env(), "RLRUNBOOK_SERVE_API_KEY": ""}, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 2, process.stderr
    assert "--api-key" in process.stderr and "0.0.0.0" in process.stderr


def test_a_sample_requests_seed_is_its_sampler_and_seq_id_whatever_the_arrival_order(tmp_path):
    """Concurrent requests reach the server in any order; each is seeded by the SDK's numbering (the sampler's
    sampling_session_seq_id, the request's seq_id), so the server samples what the in-process client does for
    the same calls in the order they were made."""
    from rlrunbook.service.state import ServeState
    from rlrunbook.service.store import ServeStore

    settings = LocalSettings.from_env({**os.environ, "TINKER_LOCAL_STORAGE": str(tmp_path / "a")})
    state = ServeState(LocalServiceClient(settings), ServeStore(tmp_path / "a"))
    local = LocalServiceClient(LocalSettings.from_env({**os.environ, "TINKER_LOCAL_STORAGE": str(tmp_path / "b")}))
    try:
        other, session = (state.create_session(types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="x"),
                                               "open")["session_id"] for _ in range(2))
        state.create_sampling_session(types.CreateSamplingSessionRequest(  # another client's sampler, made first
            session_id=other, sampling_session_seq_id=0, base_model="tiny"), "open")
        for index in range(2):  # the SDK numbers a ServiceClient's samplers from 0: sampler 1 seeds apart from 0
            state.create_sampling_session(types.CreateSamplingSessionRequest(
                session_id=session, sampling_session_seq_id=index, base_model="tiny"), "open")
            local_sampler = local.create_sampling_client(base_model="tiny")
        prompts = [types.ModelInput.from_ints([5 + i, 7, 11]) for i in range(4)]
        params = types.SamplingParams(max_tokens=4, temperature=1.0)  # unseeded: the seed is the backend's
        expected = [local_sampler.sample(prompt, 2, params).result() for prompt in prompts]
        rids = {seq: state.sample(types.SampleRequest(sampling_session_id=f"{session}:sample:1", seq_id=seq,
                                                      num_samples=2, prompt=prompts[seq], sampling_params=params),
                                  "open")["request_id"] for seq in (2, 0, 3, 1)}
        import asyncio

        got = [asyncio.run(state.futures.wait(rids[seq], "open", 60))[1] for seq in range(4)]
    finally:
        state.close()
        local.close()
    decoded = [response_conv.deserialize_sample_response(body) for body in got]
    assert [[s.tokens for s in r.sequences] for r in decoded] == [[s.tokens for s in r.sequences] for r in expected]
