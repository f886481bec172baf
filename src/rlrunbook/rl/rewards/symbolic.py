r"""Symbolic equivalence of math answers (math-verify) behind a timeout that no answer can defeat.

A policy's answer is untrusted input: ``10^{10^{10}}`` or a deeply nested expression can keep sympy busy
for minutes, partly inside C code where no signal handler runs, and ``signal.alarm`` (math-verify's own
timeout) works only in the main thread. So the comparison runs in a separate worker process
(:mod:`rlrunbook.rl.rewards.symbolic_worker`), started on first use and kept for later calls; the caller
waits on its pipe with ``select`` (any thread) and kills the process when the timeout passes. The next
call starts a fresh worker. The worker dies with its parent (``PR_SET_PDEATHSIG``, and a closed pipe),
ignores Ctrl-C (the parent stops it), and is closed at interpreter exit, so it never outlives the run.

Cost: starting the worker (it imports sympy), on first use and after each timeout; then per comparison a
pipe round trip plus math-verify's own time, the first comparisons in a fresh worker being the slowest. A
timed-out comparison costs its timeout plus a restart. Verdicts are cached per ``(pred, ref)`` (the last
``_CACHE_SIZE``), so a repeated answer costs nothing. docs/performance.md gives the figures.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.errors import ConfigError

DEFAULT_TIMEOUT_S = 2.0
_STARTUP_TIMEOUT_S = 60.0  # importing sympy on a loaded machine; only the first call waits for it
_CACHE_SIZE = 4096


@dataclass(frozen=True)
class SymbolicVerdict:
    """``equal``: the answers are one; ``timed_out``: the comparison was stopped (then ``equal`` is False)."""

    equal: bool
    timed_out: bool = False


class SymbolicChecker:
    """A lazily started math-verify worker process; thread-safe; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._buffer = b""
        self._cache: OrderedDict[tuple[str, str], SymbolicVerdict] = OrderedDict()
        self.started = 0  # worker processes started (a killed one is replaced): for tests and diagnostics

    def compare(self, pred: str, ref: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> SymbolicVerdict:
        """Whether ``pred`` and ``ref`` are equivalent; False (``timed_out``) when that takes over ``timeout_s``."""
        if not timeout_s > 0:
            raise ConfigError(f"math symbolic timeout {timeout_s!r} must be > 0 seconds, e.g. 2.")
        key = (pred, ref)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            verdict = self._ask(pred, ref, timeout_s)
            self._cache[key] = verdict
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return verdict

    def close(self) -> None:
        """Stop the worker (it exits on end of input; killed if it does not within a second)."""
        with self._lock:
            self._stop()

    # -- the worker process -------------------------------------------------------------------------------
    def _ask(self, pred: str, ref: str, timeout_s: float) -> SymbolicVerdict:
        process = self._ensure_started()
        try:
            process.stdin.write((json.dumps({"pred": pred, "ref": ref}) + "\n").encode("utf-8"))
            process.stdin.flush()
        except BrokenPipeError:  # the worker died since the last call: one fresh try
            self._stop()
            return self._ask(pred, ref, timeout_s)
        line = self._read_line(process, timeout_s)
        if line is None:
            self._stop(kill=True)  # it is still busy with this answer: the only way to stop it
            return SymbolicVerdict(False, timed_out=True)
        return SymbolicVerdict(bool(json.loads(line)["equal"]))

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._stop()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[3])  # the folder holding the rlrunbook package
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        self._process = subprocess.Popen(
            [sys.executable, "-m", "rlrunbook.rl.rewards.symbolic_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self._buffer = b""
        self.started += 1
        ready = self._read_line(self._process, _STARTUP_TIMEOUT_S)
        message = json.loads(ready) if ready else {"error": "no answer"}
        if not message.get("ready"):
            self._stop(kill=True)
            raise ConfigError(f"the math checker's symbolic worker did not start ({message.get('error')}): "
                              "it needs the math-verify package. Run `pip install math-verify` (a dependency "
                              "of rlrunbook) in this environment.")
        return self._process

    def _read_line(self, process: subprocess.Popen, timeout_s: float) -> bytes | None:
        """The worker's next output line, or None when it gives none within ``timeout_s`` (or died)."""
        deadline = time.monotonic() + timeout_s
        fd = process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # end of file: the worker exited
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _stop(self, kill: bool = False) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            if kill:
                process.kill()
            else:
                process.stdin.close()
            try:
                process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            if not stream.closed:
                stream.close()


_checker = SymbolicChecker()
atexit.register(_checker.close)


def symbolic_equal(pred: str, ref: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> SymbolicVerdict:
    """:meth:`SymbolicChecker.compare` on the process-wide checker."""
    return _checker.compare(pred, ref, timeout_s)


def close_checker() -> None:
    """Stop the process-wide checker's worker now (it restarts on the next comparison)."""
    _checker.close()
