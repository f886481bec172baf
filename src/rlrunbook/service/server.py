"""Start the server: check the options, load nothing until asked, print the URL once it accepts connections."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.errors import ConfigError

API_KEY_ENV = "RLRUNBOOK_SERVE_API_KEY"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_MIB = 64


@dataclass(frozen=True)
class ServeOptions:
    """What ``rlrunbook serve`` was given.

    Attributes:
        host: the address to bind (loopback by default; any other needs ``api_key``).
        port: the TCP port; 0 picks a free one (printed in the ready line).
        storage: where ``tinker://`` checkpoints live (None: the local backend's, ``TINKER_LOCAL_STORAGE``).
        api_key: the key every request but ``healthz`` must carry as ``X-API-Key`` (None: no key).
        device: the torch device of the local backend (None: ``TINKER_LOCAL_DEVICE``, else cuda if available).
        max_body_bytes: the largest request body accepted (413 above it).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    storage: Path | None = None
    api_key: str | None = None
    device: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_MIB * 2**20


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
    if options.api_key is not None and not options.api_key.startswith("tml-"):
        raise ConfigError(f"the API key (--api-key or {API_KEY_ENV}) must start with 'tml-': the Tinker SDK refuses "
                          "to send any other. Choose one such as tml-<random letters>.")
    if options.api_key is None and not is_loopback(options.host):
        raise ConfigError(f"--host {options.host} would serve training and sampling to the network without a key. "
                          f"Pass --api-key (or set {API_KEY_ENV}), or bind 127.0.0.1.")
    if not 0 <= options.port <= 65535:
        raise ConfigError(f"--port {options.port} is not a TCP port (0..65535; 0 picks a free one).")
    if options.max_body_bytes < 1:
        raise ConfigError("--max-body-mib must be at least 1.")


def build_app(service, options: ServeOptions):
    """The ASGI app over ``service`` (a LocalServiceClient): the door around the routes."""
    from starlette.applications import Starlette

    from rlrunbook.service.door import Door
    from rlrunbook.service.routes import routes
    from rlrunbook.service.state import ServeState

    app = Starlette(routes=routes())
    app.state.serve = ServeState(service)
    app.state.max_body_bytes = options.max_body_bytes
    return Door(app, options.api_key, options.max_body_bytes)


def local_service(options: ServeOptions):
    """The local backend's ServiceClient, with the settings of ``TINKER_LOCAL_*`` and the options on top."""
    from rlrunbook.backend import LocalServiceClient, LocalSettings

    settings = LocalSettings.from_env()
    changes: dict[str, object] = {}
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
    import uvicorn

    check_options(options)
    sock = _bind(options.host, options.port)
    service = local_service(options)
    print(f"rlrunbook serve: checkpoints under {service.settings.resolved_storage_dir()}, device "
          f"{service.settings.device}", file=sys.stderr, flush=True)
    app = build_app(service, options)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    url = base_url(options.host, sock.getsockname()[1])

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"rlrunbook serve: ready; TINKER_BASE_URL={url}", flush=True)
        await task

    try:
        asyncio.run(run())
    finally:
        app.app.state.serve.close()
        sock.close()
    print("rlrunbook serve: stopped", file=sys.stderr, flush=True)
    return 0
