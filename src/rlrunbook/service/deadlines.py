"""Read deadlines: a request's headers, then its body, must arrive in time, or the connection is closed.

uvicorn closes a connection left idle between requests (``timeout_keep_alive``), but not one that is sending:
a client that opens a connection and sends nothing, trickles its headers a byte at a time, or declares a
``Content-Length`` and never finishes the body would hold its connection (and a task, and the body read so far)
forever, and enough of them starve everyone else (slowloris). :func:`deadline_protocol` makes uvicorn's own h11
protocol class keep two deadlines per request:

- **headers**: from the moment a connection opens, or the first byte of a next request on a kept-alive
  connection, until the request line and headers are complete: ``header_timeout_s``;
- **body**: from the end of the headers until the whole body has arrived: ``body_timeout_s``, a total (a
  body trickled a byte at a time does not renew it), so it bounds the slowest upload accepted
  (``--max-body-mib`` over ``--body-timeout``).

Past either the client gets ``408`` (when it sent something and no answer has started) and the connection is
closed; the route reading the body sees the client gone. While the app works on a request (a long-polled future
waits up to 25 s) no deadline runs: a client that has sent its request is never cut off. A normal SDK client
sends a request's headers and body at once and is not affected.
"""

from __future__ import annotations

import asyncio
import json

DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0


def timeout_response(phase: str, seconds: float, option: str) -> bytes:
    """The raw ``408`` written before closing a connection whose ``phase`` (headers or body) ran out of time."""
    body = json.dumps({"detail": f"the request's {phase} did not arrive within {seconds:g} s (rlrunbook serve "
                                 f"{option}); the connection is closed."}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def deadline_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                      body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the header and body deadlines of this module (pass it as ``Config(http=...)``);
    uvicorn and h11 are imported here, so importing this module needs neither."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        """One connection: the deadline of the phase its current request is in (see the module docstring)."""

        _deadline: asyncio.TimerHandle | None = None
        _phase: str | None = None  # "headers" | "body" | None (idle between requests, or the app is working)
        _fresh = True  # no request seen yet on this connection

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._fresh = False
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def _follow(self) -> None:
            """Arm the deadline of the phase the client is in now (kept while the phase stays the same)."""
            if self.transport is None or self.transport.is_closing():
                self._arm(None)
                return
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._arm("body")
            elif state is h11.IDLE and (self._fresh or self.conn.trailing_data[0]):
                self._arm("headers")
            else:
                self._arm(None)

        def _arm(self, phase: str | None) -> None:
            if phase == self._phase:
                return
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._phase = phase
            if phase is not None:
                seconds = header_timeout_s if phase == "headers" else body_timeout_s
                self._deadline = self.loop.call_later(seconds, self._expire, phase)

        def _expire(self, phase: str) -> None:
            self._deadline, self._phase = None, None
            if self.transport is None or self.transport.is_closing():
                return
            sent = bool(self.conn.trailing_data[0]) if phase == "headers" else True
            if sent and (self.cycle is None or phase == "headers" or not self.cycle.response_started):
                option, seconds = (("--header-timeout", header_timeout_s) if phase == "headers"
                                   else ("--body-timeout", body_timeout_s))
                self.transport.write(timeout_response(phase, seconds, option))
            self.transport.close()

    return DeadlineH11Protocol
