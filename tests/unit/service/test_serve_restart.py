"""``rlrunbook serve`` is durable: killed (SIGKILL) and started again on the same storage, it loses nothing it
acknowledged. The unmodified Tinker SDK drives it throughout, across the kill; the store and the ordering
underneath are checked on their own too.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from rlrunbook.backend.storage import ADAPTER_FILE, CheckpointStore, TinkerPath, staged_folder
from rlrunbook.service.futures import SeqOrder
from rlrunbook.service.store import ServeStore, tenant_of
from rlrunbook.testing.commands import installed_rlrunbook
from rlrunbook.testing.serve import start_server

pytestmark = pytest.mark.slow

KEY = "tml-restart-test-key"


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                                       "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32")})


DATA = [_datum([1, 2, 3, 4, 5, 6]), _datum([9, 8, 7, 6])]
LONG = [_datum([(7 * i + j) % 200 + 3 for j in range(1200)]) for i in range(24)]  # ~0.5 s per call on tiny


def _pending_calls(server, model_id: str) -> int:
    status = httpx.get(f"{server.url}/api/v1/rlrunbook/status", headers={"X-API-Key": KEY}, timeout=30).json()
    return next(m["pending_calls"] for m in status["models"] if m["model_id"] == model_id)


def _files_holding(root: Path, secret: bytes) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and secret in path.read_bytes()]


def test_a_killed_server_restarts_with_everything_it_acknowledged(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    storage = tmp_path / "storage"
    server = start_server(storage, "--api-key", KEY)
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    training.forward_backward(DATA, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = training.save_state("acknowledged").result().path
    at_save = training.forward(DATA, "cross_entropy").result()
    training.forward_backward(DATA, "cross_entropy").result()  # a step after the save: lost with the server
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    queued = [training.forward_backward(LONG, "cross_entropy") for _ in range(8)]
    deadline = time.monotonic() + 120
    while _pending_calls(server, training.model_id) < 3:
        assert time.monotonic() < deadline, "the long calls never queued"
        time.sleep(0.05)
    server.kill()
    first_output = server.output

    restarted = start_server(storage, "--api-key", KEY, port=server.port)
    try:
        assert "pending now answer that the server restarted" in restarted.output
        # The calls the kill cut off answer, through the SDK's own polling across the outage: none hangs. Those
        # the server had accepted say it restarted while they were pending; those the SDK sent again after the
        # restart are refused as every call of a model without weights is, naming the state to load.
        outcomes = []
        for future in queued:
            try:
                future.result(timeout=180)
                outcomes.append("done")
            except tinker.RequestFailedError as error:
                pending = "restarted while this request was pending" in str(error)
                assert pending or f"load_state('{saved}')" in str(error), error
                outcomes.append("pending" if pending else "refused")
        assert outcomes.count("pending") >= 3, outcomes
        # The model's weights died with the server: its calls are refused, naming the state to load.
        with pytest.raises(tinker.RequestFailedError, match=f"load_state\\('{saved}'\\)"):
            training.forward(DATA, "cross_entropy").result(timeout=120)
        training.load_state(saved).result(timeout=120)
        resumed = training.forward(DATA, "cross_entropy").result(timeout=120)
        assert resumed.metrics["loss:sum"] == at_save.metrics["loss:sum"]
        for got, want in zip(resumed.loss_fn_outputs, at_save.loss_fn_outputs, strict=True):
            assert got["logprobs"].tolist() == want["logprobs"].tolist()
        training.forward_backward(DATA, "cross_entropy").result(timeout=120)  # and training goes on from there
        assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120).metrics
        # Every saved checkpoint lists and loads, also from a new client.
        rest = service.create_rest_client()
        run_id = saved.split("/")[2]
        assert [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints] == [saved]
        fresh = tinker.ServiceClient(base_url=restarted.url, api_key=KEY)
        again = fresh.create_training_client_from_state(saved).result()
        assert again.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == at_save.metrics["loss:sum"]
    finally:
        restarted.stop()
    # The key is in no log line and no file the server wrote.
    assert KEY not in first_output and KEY not in restarted.output
    assert _files_holding(storage, KEY.encode()) == []


def test_a_second_server_on_the_same_storage_is_refused(tmp_path):
    server = start_server(tmp_path / "storage")
    try:
        import subprocess

        second = subprocess.run([installed_rlrunbook(), "serve", "--port", "0", "--storage", str(tmp_path / "storage")],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert "another rlrunbook serve uses the storage" in second.stderr and "--storage" in second.stderr
    finally:
        server.stop()


# -- underneath: the store, staged checkpoints, the order of calls -------------------------------------------
def test_the_store_answers_after_a_restart_what_it_recorded(tmp_path):
    store = ServeStore(tmp_path)
    tenant = tenant_of("tml-someone-s-key")
    assert "tml-" not in tenant
    store.add_future("req-done", tenant, "m", 1, "call")
    store.future_done("req-done", b'{"ok": 1}', "json")
    store.add_future("req-pending", tenant, "m", 2, "call")
    store.close()
    store = ServeStore(tmp_path)  # as a new server on the same storage
    assert store.fail_pending("restarted") == 1
    assert store.future("req-pending").status == "failed" and store.future("req-pending").error == "restarted"
    assert store.future("req-done").body == b'{"ok": 1}'
    assert store.call_future("m", "call", 1) == "req-done" and store.call_future("m", "call", 3) is None
    store.future_delivered("req-done")
    assert store.sweep(now=time.time() + 601) == 1 and store.future("req-done") is None


def test_a_save_cut_off_leaves_no_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    path = TinkerPath("local-x", "weights", "cut")
    with pytest.raises(RuntimeError, match="killed"), staged_folder(store.folder(path)) as staging:
        (staging / ADAPTER_FILE).write_bytes(b"half")
        raise RuntimeError("killed mid-save")
    assert not store.folder(path).exists() and store.checkpoints("local-x") == []
    # What a SIGKILL leaves (the staging folder, never renamed) is not a checkpoint either.
    left = store.folder(path).with_name(".cut.saving-dead")
    left.mkdir(parents=True)
    (left / ADAPTER_FILE).write_bytes(b"half")
    assert store.checkpoints("local-x") == []
    with staged_folder(store.folder(path)) as staging:
        (staging / ADAPTER_FILE).write_bytes(b"whole")
    assert [p.path for p, _ in store.checkpoints("local-x")] == ["tinker://local-x/weights/cut"]
    shutil.rmtree(left)


def test_a_call_whose_predecessor_never_arrives_fails_instead_of_waiting_forever():
    order, ran = SeqOrder("gap", first=1, gap_timeout_s=0.3), []
    first = order.submit(1, lambda: ran.append(1))
    stranded = order.submit(3, lambda: ran.append(3))  # 2 was lost
    with pytest.raises(ValueError, match="seq_id 2 of this model never arrived"):
        stranded.result(timeout=30)
    first.result(timeout=30)
    assert order.submit(4, lambda: ran.append(4) or "ran").result(timeout=30) == "ran"
    assert ran == [1, 4]
    order.close()
