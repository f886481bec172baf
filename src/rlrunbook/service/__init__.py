"""``rlrunbook serve``: the local backend as a Tinker service over HTTP, for the unmodified Tinker SDK.

``TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python train.py`` drives this server with
``tinker.ServiceClient()`` from any process or machine; the server computes with the same local clients as
``LocalServiceClient`` in process (:mod:`rlrunbook.service.state`), so the numbers are the same bits.

Modules, bottom up: :mod:`~rlrunbook.service.wire` (the SDK's protobuf bodies, both ways),
:mod:`~rlrunbook.service.store` (the SQLite records a restart finds),
:mod:`~rlrunbook.service.futures` (request ids and long-polling; per-model ``seq_id`` order),
:mod:`~rlrunbook.service.records` (a session's, model's and sampler's record; the errors of an id),
:mod:`~rlrunbook.service.holdings` (the records by id, looked up for the caller's tenant),
:mod:`~rlrunbook.service.sessions` (heartbeats, finish, expiry), :mod:`~rlrunbook.service.samplers`
(sampling sessions, sample), :mod:`~rlrunbook.service.models` (training models and their calls in ``seq_id``
order), :mod:`~rlrunbook.service.recovery` (what a restart finds), :mod:`~rlrunbook.service.state` (the one
object the routes call), :mod:`~rlrunbook.service.admission` (API key, body size),
:mod:`~rlrunbook.service.routes` (HTTP to state), :mod:`~rlrunbook.service.deadlines` (header and body read
deadlines of each connection), :mod:`~rlrunbook.service.server` (options, bind, run).

Why Starlette under uvicorn: the SDK's protocol is a few dozen plain routes with JSON or protobuf bodies and
long-polled futures, so an ASGI toolkit fits it without a framework's schema layer: Starlette gives routing,
raw bodies (protobuf) and async handlers that can wait on a future for 25 s without holding a thread, and
uvicorn is the reference ASGI server (HTTP/1.1 keep-alive, graceful shutdown, binding a socket we opened, so
port 0 can be printed). FastAPI would add request validation we already get from the SDK's own pydantic
request types, and a dependency on its version cadence; a stdlib ``http.server`` would hold a thread per
long poll and has no graceful shutdown.
"""

from rlrunbook.service.server import ServeOptions, check_options, serve

__all__ = ["ServeOptions", "check_options", "serve"]
