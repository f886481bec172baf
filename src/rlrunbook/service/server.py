"""Start the server: check the options, take the storage, load nothing until asked, print the URL once it
accepts connections; end idle sessions while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.allocator import keep_freed_memory
from rlrunbook.errors import ConfigError
from rlrunbook.service.deadlines import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from rlrunbook.service.holdings import DEFAULT_FORGET_AFTER_S, TenantLimits
from rlrunbook.service.sessions import DEFAULT_SESSION_TIMEOUT_S

API_KEY_ENV = "RLRUNBOOK_SERVE_API_KEY"  # one key, or several separated by commas (one tenant each)
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_MIB = 64
LOCK_FILE = "serve.lock"
SERVE_BATCH_WINDOW_MS = 20
CHECKPOINT_SWEEP_S = 60.0  # how often expired checkpoints are looked for (a TTL is at least an hour)
STOP_TIMEOUT_S = 120.0  # how long a stopping server waits for the backend's running call

logger = logging.getLogger("rlrunbook.serve")


def keys_from(option: list[str] | None, environment: str | None) -> tuple[str, ...]:
    """The keys of ``--api-key`` (repeatable), else of ``RLRUNBOOK_SERVE_API_KEY`` (comma-separated)."""
    raw = option if option else (environment or "").split(",")
    return tuple(key.strip() for key in raw if key.strip())


@dataclass(frozen=True)
class ServeOptions:
    """What ``rlrunbook serve`` was given.

    Attributes:
        host: the address to bind (loopback by default; any other needs ``api_key``).
        port: the TCP port; 0 picks a free one (printed in the ready line).
        storage: where ``tinker://`` checkpoints and the server's records live (None: the local backend's,
            ``TINKER_LOCAL_STORAGE``).
        api_keys: the keys a request but ``healthz`` may carry as ``X-API-Key``, one tenant each (empty: none).
        device: the torch device of the local backend (None: ``TINKER_LOCAL_DEVICE``, else cuda if available).
        max_body_bytes: the largest request body accepted (413 above it).
        session_timeout_s: a session without a heartbeat for this long expires and its models are released.
        forget_after_s: an ended session, its models, samplers and request ids are forgotten (memory and store)
            this long after it ended; until then their ids answer why it ended, after it as unknown ones.
        max_sessions, max_models: what one tenant (key) may hold at once; more is refused with 429.
        max_stored_bytes: the bytes one tenant's checkpoints may hold on disk; a save past it is refused with 429.
        header_timeout_s, body_timeout_s: a request's headers, then its whole body, must arrive within these
            (408 and the connection closed otherwise; :mod:`rlrunbook.service.deadlines`).
        base_models: the base models clients may load (folders and registry names; None: the built-ins, the
            model cache's folders and the Hugging Face cache's models; see :mod:`rlrunbook.service.base_models`).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    storage: Path | None = None
    api_keys: tuple[str, ...] = ()
    device: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_MIB * 2**20
    session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S
    forget_after_s: float = DEFAULT_FORGET_AFTER_S
    max_sessions: int = TenantLimits.sessions
    max_models: int = TenantLimits.models
    max_stored_bytes: int = TenantLimits.stored_bytes
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    base_models: tuple[str, ...] | None = None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_options(options: ServeOptions) -> None:
    """``ConfigError`` naming the option for a server that would be open to the network, or a key the SDK
    cannot send."""
    for key in options.api_keys:
        if not key.startswith("tml-") or len(key) < 12 or not key.isprintable() or any(c in key for c in " ,"):
            raise ConfigError(f"each API key (--api-key or {API_KEY_ENV}) must start with 'tml-' (the Tinker SDK "
                              "refuses to send any other), hold at least 8 characters after it, and no space or "
                              "comma. Choose one such as tml-<random letters>.")
    if len(set(options.api_keys)) != len(options.api_keys):
        raise ConfigError("an API key is given twice; give each tenant's key once.")
    if not options.api_keys and not is_loopback(options.host):
        raise ConfigError(f"--host {options.host} would serve training and sampling to the network without a key. "
                          f"Pass --api-key (or set {API_KEY_ENV}), or bind 127.0.0.1.")
    if not 0 <= options.port <= 65535:
        raise ConfigError(f"--port {options.port} is not a TCP port (0..65535; 0 picks a free one).")
    if options.max_body_bytes < 1:
        raise ConfigError("--max-body-mib must be at least 1.")
    for option, value in (("--max-sessions", options.max_sessions), ("--max-models", options.max_models)):
        if not 1 <= value <= 100_000:
            raise ConfigError(f"{option} {value} must be from 1 to 100,000 (per API key).")
    if options.base_models is not None and not any(value.strip() for value in options.base_models):
        raise ConfigError("--base-models names no folder or model; give at least one (or leave the option out for "
                          "the built-ins and the cached models).")
    if not 1 <= options.session_timeout_s <= 7 * 24 * 3600:
        raise ConfigError(f"--session-timeout {options.session_timeout_s:g} must be from 1 second to a week (the SDK "
                          "sends a heartbeat every 10 s, so 60 or more keeps a slow client's session).")
    if options.max_stored_bytes < 1:
        raise ConfigError(f"--max-stored-bytes {options.max_stored_bytes} must be at least 1 byte (write it like "
                          "50GiB).")
    for option, value in (("--header-timeout", options.header_timeout_s), ("--body-timeout", options.body_timeout_s)):
        if not 0.1 <= value <= 3600:
            raise ConfigError(f"{option} {value:g} must be from 0.1 to 3,600 seconds.")
    if not 0 <= options.forget_after_s <= 365 * 24 * 3600:
        raise ConfigError(f"--forget-after {options.forget_after_s:g} must be from 0 seconds to a year.")


def build_app(service, options: ServeOptions):
    """The ASGI app over ``service`` (a LocalServiceClient) and its storage's records: admission around the routes."""
    from starlette.applications import Starlette

    from rlrunbook.service.admission import Admission
    from rlrunbook.service.base_models import BaseModels
    from rlrunbook.service.routes import routes
    from rlrunbook.service.state import ServeState
    from rlrunbook.service.store import ServeStore

    app = Starlette(routes=routes())
    store = ServeStore(service.settings.resolved_storage_dir())
    app.state.serve = ServeState(service, store, options.session_timeout_s,
                                 TenantLimits(options.max_sessions, options.max_models, options.max_stored_bytes),
                                 options.forget_after_s, base_models=BaseModels.from_option(options.base_models))
    app.state.max_body_bytes = options.max_body_bytes
    return Admission(app, options.api_keys, options.max_body_bytes)


@contextlib.contextmanager
def storage_lock(root: Path) -> Iterator[None]:
    """Hold ``<root>/serve.lock`` while serving: a second server on the same storage would fail the first one's
    pending calls as its own restart's; it is refused at start instead, naming the option."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(f"another rlrunbook serve uses the storage {root}; stop it, or give this one another "
                          "--storage.") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


async def expire_sessions(state, period_s: float, checkpoint_period_s: float = CHECKPOINT_SWEEP_S) -> None:
    """Every ``period_s``: end the sessions whose heartbeats stopped (their models' memory freed by one
    collection per sweep) and forget those ended longer than the grace period; every ``checkpoint_period_s``:
    remove the checkpoints whose TTL has passed, and drop from the store the results delivered long enough ago
    (:meth:`~rlrunbook.service.store.ServeStore.sweep`)."""
    loop = asyncio.get_running_loop()
    next_checkpoints = loop.time()
    while True:
        await asyncio.sleep(period_s)
        try:
            swept = await asyncio.to_thread(state.sweep)
        except Exception:
            logger.exception("expiring idle sessions failed")
        else:
            for session_id in swept.expired:
                print(f"rlrunbook serve: session {session_id} expired (no heartbeat for "
                      f"{state.session_timeout_s:g} s); its models were released", file=sys.stderr, flush=True)
        if loop.time() < next_checkpoints:
            continue
        next_checkpoints = loop.time() + checkpoint_period_s
        try:
            await asyncio.to_thread(state.drop_old_results)
        except Exception:
            logger.exception("dropping delivered results from the store failed")
        try:
            removed = await asyncio.to_thread(state.remove_expired_checkpoints)
        except Exception:
            logger.exception("removing expired checkpoints failed")
            continue
        for path in removed:
            print(f"rlrunbook serve: checkpoint {path} expired (its TTL passed) and was removed", file=sys.stderr,
                  flush=True)


def local_service(options: ServeOptions):
    """The local backend's ServiceClient, with the settings of ``TINKER_LOCAL_*`` and the options on top.

    A batch whose advantages are all 0 is trained as the hosted service trains it (loss and gradient 0), as
    the scripts the server serves expect, unless ``TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES`` says otherwise; sample
    requests sent at once (they arrive a few milliseconds apart) are batched within ``SERVE_BATCH_WINDOW_MS``
    unless ``TINKER_LOCAL_BATCH_WINDOW_MS`` says otherwise."""
    from rlrunbook.backend import LocalServiceClient, LocalSettings

    settings = LocalSettings.from_env()
    changes: dict[str, object] = {}
    if not os.environ.get("TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES", "").strip():
        changes["zero_advantage_batches"] = "accept"
    if not os.environ.get("TINKER_LOCAL_BATCH_WINDOW_MS", "").strip():
        changes["batch_window_ms"] = SERVE_BATCH_WINDOW_MS
    if options.storage is not None:
        changes["storage_dir"] = options.storage
    if options.device is not None:
        changes["device"] = options.device
    return LocalServiceClient(dataclasses.replace(settings, **changes))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port} ({error.strerror}); choose another --port (0 picks a free "
                          "one) or --host.") from None
    return sock


def base_url(host: str, port: int) -> str:
    return f"http://[{host.strip('[]')}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(options: ServeOptions) -> int:
    """Run until interrupted; print ``TINKER_BASE_URL=<url>`` once the server accepts connections."""
    check_options(options)
    with contextlib.ExitStack() as stack:
        return _serve(options, stack)


def uvicorn_config(app, options: ServeOptions):
    """How uvicorn serves ``app``: quietly, its h11 protocol with the options' header and body deadlines."""
    import uvicorn

    from rlrunbook.service.deadlines import deadline_protocol

    return uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                          http=deadline_protocol(options.header_timeout_s, options.body_timeout_s))


def _serve(options: ServeOptions, stack: contextlib.ExitStack) -> int:

    allocator = keep_freed_memory()
    service = local_service(options)
    stack.callback(service.close)
    root = service.settings.resolved_storage_dir()
    stack.enter_context(storage_lock(root))
    sock = _bind(options.host, options.port)
    stack.callback(sock.close)
    app = build_app(service, options)
    state = app.app.state.serve
    restored = state.restored
    print(f"rlrunbook serve: checkpoints and records under {root}, device {service.settings.device}; "
          f"{len(options.api_keys) or 'no'} API key(s); sessions expire after {options.session_timeout_s:g} s "
          f"without a heartbeat{'; ' + allocator if allocator else ''}", file=sys.stderr, flush=True)
    if restored["sessions"] or restored["models"]:
        print(f"rlrunbook serve: restarted on this storage: {restored['sessions']} session(s) and "
              f"{restored['models']} training model(s) known; {restored['pending_failed']} request(s) that were "
              "pending now answer that the server restarted", file=sys.stderr, flush=True)
    server = http_server(uvicorn_config(app, options), state)
    url = base_url(options.host, sock.getsockname()[1])

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        reaper = asyncio.create_task(expire_sessions(state, min(30.0, max(0.5, options.session_timeout_s / 4))))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"rlrunbook serve: ready; TINKER_BASE_URL={url}", flush=True)
        try:
            await task
        finally:
            reaper.cancel()

    try:
        asyncio.run(run())
    finally:  # no request comes in any more (a signal ended uvicorn, then is raised again here: see _Server)
        left = state.close(STOP_TIMEOUT_S)
        print(f"rlrunbook serve: stopped; running calls finished and recorded, {left} call(s) not started stay "
              "pending (a restart on this storage answers that they were)", file=sys.stderr, flush=True)
    return 0


def http_server(config, state):
    """uvicorn's server over ``config``, whose shutdown first answers every long poll "not yet" (the SDK polls
    again), so no open ``retrieve_future`` holds the shutdown until uvicorn cancels it with a traceback.

    On SIGINT/SIGTERM uvicorn stops accepting connections, waits for the requests in flight, and raises the
    signal again once it is done: :func:`rlrunbook.boundary.signals.install`'s handler then ends the command
    (exit 130/143) through ``_serve``'s ``finally``, which closes the rest in order (:meth:`ServeState.close`)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            state.futures.end_polls()
            await super().shutdown(sockets=sockets)

    return Server(config)
