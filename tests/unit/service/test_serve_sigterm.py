"""``rlrunbook serve`` stopped by SIGTERM while SDK clients create models and train: it stops cleanly (exit 143,
one line saying what it left, no traceback in its log), and a restart on the same storage has everything it
acknowledged and reports every call it left pending. The stop raced the clients intermittently, so the test
stops the server several times, at different moments of the clients' loops.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import tinker
from tinker import types

from rlrunbook.testing.serve import start_server

pytestmark = pytest.mark.slow

KEY = "tml-sigterm-test-key"
CLIENTS = 4
# One round each, on one storage (each restart is the next round's server): the stop comes while the models are
# made, then while they train and save; in the last round client 0's long calls are queued too.
STOP_AFTER_S = (2.0, 5.0, 8.0)
# What a clean stop never prints (the two messages, uvicorn's and Python's tracebacks).
NEVER = ("Traceback", "cannot schedule new futures", "Cannot operate on a closed database",
         "Exception in ASGI application", "exception calling callback")
LEFT = re.compile(r"(\d+) call\(s\) not started stay pending")
REPORTED = re.compile(r"(\d+) request\(s\) that were pending now answer that the server restarted")
# How a call cut off by the stop may end, through the SDK across the restart: with its result, or with one of these.
CUT_OFF = ("restarted while this request was pending", "rlrunbook serve restarted since training model")


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                                       "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32")})


DATA = [_datum([(5 * i + j) % 200 + 3 for j in range(48)]) for i in range(4)]
LONG = [_datum([(7 * i + j) % 200 + 3 for j in range(1200)]) for i in range(24)]  # ~0.5 s per call on tiny


@dataclass
class Acknowledged:
    """What the server answered to the clients of one round."""

    models: list[str] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    cut_off: list[str] = field(default_factory=list)  # how each call the stop interrupted ended
    errors: list[BaseException] = field(default_factory=list)


def _client(url: str, index: int, stop: threading.Event, seen: Acknowledged, long_calls: bool) -> None:
    """Each client trains in a loop, saving its state at every step; with ``long_calls`` client 0 queues long
    calls at once instead (at the stop, one runs and more wait, for longer than uvicorn waits for open requests)."""
    try:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=index).result(timeout=120)
        seen.models.append(training.model_id)
        if index == 0 and long_calls:
            for future in [training.forward_backward(LONG, "cross_entropy") for _ in range(12)]:
                future.result(timeout=120)
            return
        step = 0
        while not stop.is_set():
            training.forward_backward(DATA, "cross_entropy").result(timeout=180)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=180)
            seen.saved.append(training.save_state(f"c{index}-{step}").result(timeout=180).path)
            step += 1
    except (tinker.RequestFailedError, tinker.APIStatusError) as error:  # a call's failure, or a 410 of get_info
        if not any(part in str(error) for part in CUT_OFF):
            seen.errors.append(error)
        seen.cut_off.append(str(error))
    except BaseException as error:  # noqa: BLE001 - reported by the test
        seen.errors.append(error)


def _log_after_exit(server) -> str:
    """Everything the stopped server printed (its output is read on a thread: wait for the last line)."""
    deadline = time.monotonic() + 30
    while "interrupted (SIGTERM)" not in server.output and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.output


def _status(url: str) -> dict:
    return httpx.get(f"{url}/api/v1/rlrunbook/status", headers={"X-API-Key": KEY}, timeout=60).json()


def test_sigterm_while_clients_train_stops_cleanly_and_a_restart_has_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    storage = tmp_path / "storage"
    server = start_server(storage, "--api-key", KEY)
    all_models, all_saved = [], []
    try:
        for round_index, stop_after in enumerate(STOP_AFTER_S):
            stop, seen = threading.Event(), Acknowledged()
            last = round_index == len(STOP_AFTER_S) - 1
            threads = [threading.Thread(target=_client, args=(server.url, i, stop, seen, last), daemon=True)
                       for i in range(CLIENTS)]
            for thread in threads:
                thread.start()
            time.sleep(stop_after)
            stop.set()
            code = server.stop()
            log = _log_after_exit(server)
            assert code == 143, log  # docs/cli.md: 143 after SIGTERM, as every command
            for message in NEVER:
                assert message not in log, f"round {round_index}: {message!r} in the server's log:\n{log}"
            left = LEFT.findall(log)
            assert len(left) == 1, log

            server = start_server(storage, "--api-key", KEY, port=server.port)
            reported = REPORTED.findall(server.output)
            assert reported == left, (server.output, log)  # the restart reports exactly what the stop left
            for thread in threads:  # every call the stop cut off answers across the restart: none hangs
                thread.join(timeout=240)
                assert not thread.is_alive(), f"round {round_index}: a client's call never answered"
            assert not seen.errors, seen.errors
            all_models += seen.models
            all_saved += seen.saved

        # Everything acknowledged in every round is there: each model is known, each saved state lists.
        assert len(all_saved) >= 2, "the clients saved too little before the stops to check anything"
        known = {model["model_id"] for model in _status(server.url)["models"]}
        assert set(all_models) <= known, set(all_models) - known
        service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        rest = service.create_rest_client()
        for path in all_saved:
            listed = rest.list_checkpoints(path.split("/")[2]).result(timeout=60).checkpoints
            assert path in [c.tinker_path for c in listed], path
        loaded = service.create_training_client_from_state(all_saved[-1]).result(timeout=180)
        assert loaded.forward(DATA, "cross_entropy").result(timeout=180).metrics["loss:sum"] > 0
    finally:
        server.stop()
