"""Slow clients against a real server on loopback: a connection that sends nothing, headers trickled a byte at a
time, a declared body never finished or trickled, each closed at its deadline (408 where it sent something), while
a kept-alive connection idle between requests, a request the app works on for longer than both deadlines, and the
unmodified SDK training and sampling through the same server are not cut off. uvicorn runs the app as
``rlrunbook serve`` runs it (:func:`rlrunbook.service.server.uvicorn_config`), in a thread, with deadlines of
1 s (headers) and 2 s (body)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import Future

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings

KEY = "tml-deadline-key-01"
HEADER_S, BODY_S = 1.0, 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import torch
    import uvicorn

    from rlrunbook.service.server import ServeOptions, _bind, build_app, uvicorn_config

    storage = tmp_path_factory.mktemp("deadlines") / "storage"
    options = ServeOptions(port=0, api_keys=(KEY,), storage=storage, header_timeout_s=HEADER_S,
                           body_timeout_s=BODY_S)
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    app = build_app(service, options)
    sock = _bind("127.0.0.1", 0)
    running = uvicorn.Server(uvicorn_config(app, options))
    thread = threading.Thread(target=lambda: asyncio.run(running.serve(sockets=[sock])), daemon=True)
    thread.start()
    for _ in range(200):
        if running.started:
            break
        time.sleep(0.05)
    assert running.started
    yield sock.getsockname()[1], app.app.state.serve
    running.should_exit = True
    thread.join(timeout=30)
    app.app.state.serve.close()
    sock.close()


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _read_until_closed(conn: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (perf_counter)."""
    conn.settimeout(limit_s)
    got = b""
    while True:
        part = conn.recv(65536)
        if not part:
            return got, time.perf_counter()
        got += part


def _response(conn: socket.socket) -> tuple[bytes, bytes]:
    """One whole response on a kept-alive connection: its status line and its body (by content-length)."""
    got = b""
    while b"\r\n\r\n" not in got:
        part = conn.recv(65536)
        assert part, f"closed before a response: {got!r}"
        got += part
    head, body = got.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        part = conn.recv(65536)
        assert part, "closed in the middle of a response"
        body += part
    assert len(body) == length
    return head.split(b"\r\n", 1)[0], body


def _head(path: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", f"x-api-key: {KEY}", "content-type: application/json"]
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _trickle(conn: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> None:
    for byte in data:
        if stop.is_set():
            return
        try:
            conn.sendall(bytes([byte]))
        except OSError:  # closed by the server: what the test waits for
            return
        time.sleep(every_s)


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(server):
    port, _ = server
    conn = _connect(port)
    opened = time.perf_counter()
    got, closed = _read_until_closed(conn)
    assert HEADER_S * 0.9 <= closed - opened <= HEADER_S + 1.5
    assert got == b""  # nothing was asked, nothing is answered


def test_headers_trickled_a_byte_at_a_time_are_cut_off_with_408(server):
    port, _ = server
    conn, stop = _connect(port), threading.Event()
    opened = time.perf_counter()
    head = _head("/api/v1/telemetry", 2) + b"{}"
    threading.Thread(target=_trickle, args=(conn, head, 0.1, stop), daemon=True).start()  # needs ~13 s
    got, closed = _read_until_closed(conn)
    stop.set()
    assert HEADER_S * 0.9 <= closed - opened <= HEADER_S + 1.5  # the bytes did not renew the deadline
    assert got.startswith(b"HTTP/1.1 408 ")
    assert "--header-timeout" in json.loads(got.split(b"\r\n\r\n", 1)[1])["detail"]


@pytest.mark.parametrize("trickled", [False, True], ids=["stalled", "trickled"])
def test_a_body_never_finished_is_cut_off_with_408_at_the_body_deadline(server, trickled):
    port, _ = server
    conn, stop = _connect(port), threading.Event()
    conn.sendall(_head("/api/v1/telemetry", 1000) + b'{"events": [')
    sent = time.perf_counter()
    if trickled:
        threading.Thread(target=_trickle, args=(conn, b" " * 900, 0.1, stop), daemon=True).start()  # ~90 s
    got, closed = _read_until_closed(conn)
    stop.set()
    assert BODY_S * 0.9 <= closed - sent <= BODY_S + 1.5
    assert got.startswith(b"HTTP/1.1 408 ") and got.count(b"HTTP/1.1") == 1  # one answer: the 408
    assert "--body-timeout" in json.loads(got.split(b"\r\n\r\n", 1)[1])["detail"]


def test_many_slow_clients_do_not_hold_back_a_normal_request_and_are_all_closed(server):
    port, _ = server
    slow = [_connect(port) for _ in range(20)]
    for index, conn in enumerate(slow):
        conn.sendall(_head("/api/v1/telemetry", 100)[: 10 + index] if index % 2 else _head("/api/v1/telemetry", 100))
    normal = _connect(port)
    normal.sendall(_head("/api/v1/telemetry", 2) + b"{}")
    normal.settimeout(10)
    assert _response(normal)[0].startswith(b"HTTP/1.1 200 ")
    deadline = time.perf_counter() + BODY_S + 3
    for conn in slow:
        _, closed = _read_until_closed(conn, limit_s=max(0.1, deadline - time.perf_counter()))
        assert closed <= deadline
    normal.close()


def test_idle_keep_alive_and_a_long_running_request_are_not_cut_off(server):
    port, serve = server
    conn = _connect(port)
    conn.settimeout(10)
    conn.sendall(_head("/api/v1/telemetry", 2) + b"{}")
    assert _response(conn)[0].startswith(b"HTTP/1.1 200 ")
    time.sleep(HEADER_S + 0.5)  # idle between requests is the keep-alive's business (5 s), not a header deadline
    late: Future = Future()
    threading.Timer(BODY_S + 1.0, late.set_result, args=({"done": True},)).start()
    rid = serve.futures.add(late, lambda result: result, tenant=serve_tenant())
    body = json.dumps({"request_id": rid}).encode()
    asked = time.perf_counter()
    conn.sendall(_head("/api/v1/retrieve_future", len(body)) + body)
    status, answer = _response(conn)
    assert time.perf_counter() - asked >= BODY_S + 0.9  # the app worked longer than both deadlines
    assert status.startswith(b"HTTP/1.1 200 ") and json.loads(answer) == {"done": True}
    conn.close()


def serve_tenant() -> str:
    from rlrunbook.service.store import tenant_of

    return tenant_of(KEY)


def test_the_sdk_trains_and_samples_through_a_server_with_short_deadlines(server, monkeypatch):
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    port, _ = server
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4, 5], dtype="int64"),
                                        "weights": types.TensorData(data=[1.0] * 4, dtype="float32")})
    losses = []
    for _ in range(2):
        losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        time.sleep(HEADER_S + 0.2)  # a pause between calls longer than the header deadline
    assert losses[1] < losses[0]
    sampler = training.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(types.ModelInput.from_ints([3, 1, 4]), 2,
                            types.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(sample.sequences) == 2 and all(s.tokens for s in sample.sequences)
