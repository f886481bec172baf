"""``rlrunbook serve``: the local backend as a Tinker service over HTTP (docs/serve.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rlrunbook.errors import ConfigError


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"rlrunbook serve needs {' and '.join(missing)}, which this environment lacks; install "
                          "them with pip install -e '.[serve]' (scripts/setup.sh does by default).")
    from rlrunbook.service import ServeOptions, serve
    from rlrunbook.service.server import API_KEY_ENV, keys_from

    options = ServeOptions(host=args.host, port=args.port, storage=Path(args.storage) if args.storage else None,
                           api_keys=keys_from(args.api_key, os.environ.get(API_KEY_ENV)), device=args.device,
                           max_body_bytes=args.max_body_mib * 2**20, session_timeout_s=args.session_timeout,
                           forget_after_s=args.forget_after, header_timeout_s=args.header_timeout,
                           body_timeout_s=args.body_timeout,
                           max_sessions=args.max_sessions, max_models=args.max_models,
                           max_stored_bytes=args.max_stored_bytes,
                           base_models=tuple(args.base_models) if args.base_models is not None else None)
    return serve(options)


def add_command(commands) -> None:
    """``rlrunbook serve``: the local backend as a Tinker service over HTTP (docs/serve.md)."""
    serve = commands.add_parser("serve", help="serve the local backend over the Tinker SDK's HTTP protocol: "
                                              "set TINKER_BASE_URL to the URL it prints (docs/serve.md)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (127.0.0.1); any non-loopback address needs --api-key")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (8000); 0 picks a free one, printed")
    serve.add_argument("--storage", metavar="DIR",
                       help="where tinker:// checkpoints live (default: TINKER_LOCAL_STORAGE, else "
                            "~/.cache/rlrunbook/tinker)")
    serve.add_argument("--api-key", metavar="KEY", action="append",
                       help="a key clients send as TINKER_API_KEY (starts with tml-); repeat it for several "
                            "tenants, each seeing only its own sessions; default: RLRUNBOOK_SERVE_API_KEY "
                            "(comma-separated); none = no key, loopback only")
    serve.add_argument("--device", default=None, help="default: TINKER_LOCAL_DEVICE, else cuda if available, else cpu")
    serve.add_argument("--max-body-mib", type=int, default=64,
                       help="largest request body in MiB (64); larger ones are refused with 413")
    serve.add_argument("--session-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="a session whose client sent no heartbeat for this long expires and its models' "
                            "memory is freed (300; the SDK sends one every 10 s); saved checkpoints stay")
    serve.add_argument("--forget-after", type=float, default=3600.0, metavar="SECONDS",
                       help="an ended (expired or closed) session and its models, samplers and request ids are "
                            "forgotten this long after it ended (3600); until then their ids answer why it ended")
    serve.add_argument("--header-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a request's line and headers must arrive within this long of the connection opening "
                            "(or of the request's first byte) (30); else 408 and the connection is closed")
    serve.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a request's whole body must arrive within this long of its headers (60); else 408 and "
                            "the connection is closed")
    # The defaults are ServeOptions' (a test holds them equal; importing the service here would load torch).
    serve.add_argument("--max-sessions", type=int, default=64, metavar="N",
                       help="active sessions (ServiceClients) one API key may hold at once (64); more are refused "
                            "with 429 until one closes or expires")
    serve.add_argument("--max-models", type=int, default=16, metavar="N",
                       help="training models one API key may hold at once (16); a model is released when its "
                            "session ends, its checkpoints stay")
    serve.add_argument("--max-stored-bytes", type=_size, default="50GiB", metavar="SIZE",
                       help="bytes the checkpoints of one API key's runs may hold on disk (50GiB; 512MiB, 2TB or a "
                            "number of bytes); a save past it is refused with 429 until checkpoints are deleted")
    serve.add_argument("--base-models", nargs="+", action="extend", metavar="FOLDER_OR_NAME",
                       help="the base models clients may load: folders whose model folders may be named by path, "
                            "and names the model registry resolves (built-ins, hub ids); repeatable. Default: the "
                            "built-ins, the folders of the model cache and the models already in the Hugging Face "
                            "cache. Any other base model is refused with 400")
    serve.set_defaults(func=cmd_serve)


def _size(text: str) -> int:
    """``--max-stored-bytes``: a size such as 50GiB, as bytes (argparse's error names the option otherwise)."""
    from rlrunbook.rl.setup.memory_plan import parse_size

    try:
        return parse_size(text, "--max-stored-bytes")
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None

