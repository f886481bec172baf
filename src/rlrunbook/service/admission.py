"""Admission: the API key and the body size, checked before any route runs (an ASGI middleware).

Every route but ``/api/v1/healthz`` needs the ``X-API-Key`` header the SDK sends (``TINKER_API_KEY``) to
equal one of the server's keys, compared in constant time; the key names the caller's tenant
(:func:`rlrunbook.service.store.tenant_of`, a digest), set as ``request.state.tenant`` for the routes: each
tenant sees only its own sessions, models, samplers and futures. Without a key configured every request is
admitted (one tenant; the server then binds loopback only, see :func:`rlrunbook.service.server.check_options`).
A ``Content-Length`` over the limit is refused with 413 before the body is read; a body sent without one is
counted as it is read (:func:`rlrunbook.service.routes.read_body`). Several ``X-API-Key`` headers, several
``Content-Length`` headers or one that is not digits are the caller's error (400), never read as one of them.
A compressed body (any ``Content-Encoding`` but ``identity``, the SDK's zstd included) is 415: the server's
``/client/config`` tells the SDK to send none.
Keys are never logged, echoed or written.
"""

from __future__ import annotations

import hmac
import json

from rlrunbook.service.store import tenant_of

OPEN_PATHS = frozenset({"/api/v1/healthz"})


async def send_json(send, status: int, body: dict) -> None:
    """A complete JSON response on a raw ASGI ``send``."""
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class Admission:
    """ASGI middleware: 400 for ambiguous key or length headers, 415 for a compressed body, 401 without a right
    key, 413 for a declared body over ``max_body_bytes``; the tenant of the key in ``scope["state"]["tenant"]``."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int):
        self.app = app
        self._tenants = [(key.encode(), tenant_of(key)) for key in api_keys]
        self.max_body_bytes = max_body_bytes

    def _tenant(self, given: bytes) -> str | None:
        """The tenant of ``given``; every key is compared (constant time), so timing tells nothing."""
        found = None
        for key, tenant in self._tenants:
            if hmac.compare_digest(given, key):
                found = tenant
        return found

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        keys = [value for name, value in scope["headers"] if name == b"x-api-key"]
        lengths = [value for name, value in scope["headers"] if name == b"content-length"]
        if len(keys) > 1:
            await send_json(send, 400, {"detail": f"{len(keys)} X-API-Key headers: send one (TINKER_API_KEY)."})
            return
        if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
            shown = ", ".join(value.decode(errors="replace")[:20] for value in lengths)
            await send_json(send, 400, {"detail": f"Content-Length {shown!r} is not one byte count: send one "
                                                  "Content-Length of digits, or none (a chunked body)."})
            return
        encodings = [value.strip().lower() for name, value in scope["headers"] if name == b"content-encoding"]
        if any(encoding not in (b"", b"identity") for encoding in encodings):
            shown = b", ".join(encodings).decode(errors="replace")[:40]
            await send_json(send, 415, {"detail": f"Content-Encoding {shown!r}: rlrunbook serve reads uncompressed "
                                                  "bodies only (its /client/config answers "
                                                  "proto_compress_fwdbwd=false); send the body as it is."})
            return
        tenant = tenant_of(None)
        if self._tenants and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"x-api-key", b"")
            tenant = self._tenant(given)
            if tenant is None:
                reason = "no X-API-Key header" if not given else "a wrong X-API-Key"
                await send_json(send, 401, {"detail": f"{reason}: set TINKER_API_KEY to a key this server was "
                                                      "started with (--api-key or RLRUNBOOK_SERVE_API_KEY)."})
                return
        scope.setdefault("state", {})["tenant"] = tenant
        declared = headers.get(b"content-length")
        if declared is not None and int(declared) > self.max_body_bytes:
            await send_json(send, 413, {"detail": f"request body of {declared.decode(errors='replace')[:20]} bytes "
                                                  f"exceeds this server's limit of {self.max_body_bytes} bytes "
                                                  "(rlrunbook serve --max-body-mib); send fewer datums per call."})
            return
        await self.app(scope, receive, send)
