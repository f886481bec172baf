"""``rlrunbook serve`` as a process, for tests and measurements that drive it with the unmodified Tinker SDK."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rlrunbook.testing.commands import installed_rlrunbook

READY = re.compile(r"TINKER_BASE_URL=(\S+)")


@dataclass
class ServerProcess:
    """A running ``rlrunbook serve``: its URL, and everything it printed (collected as it prints)."""

    process: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL: nothing of the server runs after this (no clean-up, no flush)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C would: the server finishes and exits. Its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=60)


def start_server(storage: Path, *args: str, port: int = 0, env: dict[str, str] | None = None,
                 timeout_s: float = 180.0) -> ServerProcess:
    """Start ``rlrunbook serve --port PORT --storage STORAGE ARGS`` (port 0: a free one) and wait for its ready line.

    ``env`` is the server's whole environment (default: this process's, with the SDK's telemetry off).
    ``RuntimeError`` with what it printed if it exits, or prints no ready line within ``timeout_s``."""
    environment = dict(os.environ if env is None else env)
    environment.setdefault("TINKER_TELEMETRY", "0")
    process = subprocess.Popen([installed_rlrunbook(), "serve", "--port", str(port), "--storage", str(storage), *args],
                               env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            match = READY.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout_s) or not found:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        raise RuntimeError(f"rlrunbook serve did not start: {''.join(lines)[-3000:]}")
    return ServerProcess(process, found[0], lines)
