"""How a command stops on a signal: Ctrl-C (SIGINT), SIGTERM (``kill``, a scheduler) and SIGHUP (the terminal
closed) end every command the same way, from the first line of ``main`` to its last.

Each one becomes a ``KeyboardInterrupt`` in the main thread (through :func:`install`, SIGINT as Python's
own handler does it), so the code in between unwinds as on Ctrl-C: a training run marks
itself ``interrupted`` and keeps its last checkpoint (:mod:`rlrunbook.rl.training.interrupt`). :func:`finish`
then stops every local backend still computing (a process must not exit while a backend thread is inside
torch: libstdc++ aborts it) and returns ``128 + N``; nothing prints a traceback.

The ``rlrunbook`` command enters through :func:`rlrunbook.cli.launch.launch`, which installs the handlers
before anything heavy is imported, so a signal in the first instant of start-up (while torch and transformers
load) stops it the same way; started with the signals blocked, it is covered from ``exec`` on
(:func:`unblock`). A process started in the background by a non-interactive shell inherits SIGINT ignored; it
stays ignored (the shell asked for that), so such a process is stopped with SIGTERM or SIGHUP.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from rlrunbook import pending_signal
from rlrunbook.pending_signal import Stopped

__all__ = ["STOP_SIGNALS", "Stopped", "exit_code", "finish", "finish_now", "install", "interrupted_by", "signal_name",
           "stop_backends", "unblock"]

# The signals that stop a command, besides SIGINT (whose handler Python installs itself).
STOP_SIGNALS = ("SIGTERM", "SIGHUP")
# How long a stopping command waits for a backend's running call before it exits without waiting.
STOP_TIMEOUT_S = 120.0


def _raise_stopped(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    pending_signal.record(name)
    raise Stopped(name)


def _raise_interrupt(signum: int, frame: object) -> None:
    """Python's own Ctrl-C behaviour (``KeyboardInterrupt`` in the main thread), recorded."""
    pending_signal.record("SIGINT")
    raise KeyboardInterrupt


def interrupted_by(error: BaseException) -> KeyboardInterrupt | None:
    """The interrupt to handle instead of ``error`` when a signal is pending: ``error`` is then its consequence
    (a library turned the KeyboardInterrupt into an error of its own), not a failure. None when no signal
    came (see :mod:`rlrunbook.pending_signal`)."""
    interrupt = pending_signal.pending()
    if interrupt is not None:
        interrupt.__cause__ = error
    return interrupt


def install() -> Callable[[], None]:
    """Turn SIGTERM and SIGHUP into :class:`Stopped` in this process, and SIGINT (where Python's own handler
    has it) into ``KeyboardInterrupt`` as Python does, each recorded for :func:`interrupted_by`; returns what
    restores the old handlers.

    Only the main thread can set handlers: called from another (an in-process test runner), it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an inherited "ignore" stays ignored
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupt)
    # SIGTERM last: once its handler shows (/proc/<pid>/status SigCgt, what a supervisor may watch), every
    # handler is in place.
    for name in reversed(STOP_SIGNALS):
        number = getattr(signal, name, None)
        if number is not None:
            previous[number] = signal.signal(number, _raise_stopped)

    def restore() -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)

    return restore


def unblock() -> None:
    """Unblock SIGINT, SIGTERM and SIGHUP in this thread, once their handlers are installed.

    The interpreter's own start-up, before the first line of rlrunbook runs, has the operating system's
    defaults (a signal then ends the process unhandled). A supervisor that must not lose a signal in that
    window starts the command with these signals blocked (``env --block-signal=INT,TERM,HUP rlrunbook ...``,
    or ``posix_spawn`` with a signal mask): the mask survives ``exec``, a signal sent meanwhile stays
    pending, and it is delivered here, to the handlers. Without a blocked mask this changes nothing.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return
    numbers = {getattr(signal, name) for name in ("SIGINT", *STOP_SIGNALS) if hasattr(signal, name)}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)


def signal_name(interrupt: KeyboardInterrupt) -> str:
    """``SIGTERM``/``SIGHUP`` for a :class:`Stopped` (or a ``RunInterrupted`` carrying one), else ``SIGINT``."""
    return getattr(interrupt, "signal_name", "SIGINT")


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """``128 + N`` for the signal N that stopped the command: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP)."""
    return 128 + int(getattr(signal, signal_name(interrupt)))


def _say(line: str) -> None:
    """Print to stderr; a closed terminal (SIGHUP) or pipe makes that fail, which must not become a traceback."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _exit_now(code: int) -> None:
    """Leave at once: a backend thread is still inside torch, and a normal exit would unwind the runtime
    under it (libstdc++ then aborts with "terminate called without an active exception", exit -6)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def finish(interrupt: KeyboardInterrupt) -> int:
    """The exit status after ``interrupt``, with one line saying what was kept; stops the local backends.

    A training run's :class:`~rlrunbook.errors.RunInterrupted` names its run and last checkpoint; any other
    command says which signal stopped it. Backends still computing are stopped (queued calls cancelled, the
    running one finished); when one does not end (a second signal, or :data:`STOP_TIMEOUT_S`), the process
    exits without unwinding.
    """
    from rlrunbook.errors import RunInterrupted

    pending_signal.acknowledge()
    name, code = signal_name(interrupt), exit_code(interrupt)
    stopped = True
    if isinstance(interrupt, RunInterrupted):
        kept = (f"last checkpoint {interrupt.last_checkpoint}: continue with --resume-from {interrupt.run_dir}"
                if interrupt.last_checkpoint else "no checkpoint was taken yet (--checkpoint-every N keeps them)")
        _say(f"interrupted ({name}): run {interrupt.run_dir} marked 'interrupted'; {kept}")
        stopped = interrupt.backend_stopped
    else:
        _say(f"interrupted ({name})")
    if stopped:  # a run whose backend did not stop (a second signal) is not waited for again
        stopped = stop_backends()
    if not stopped:
        _exit_now(code)
    return code


def stop_backends(timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop every local backend of this process (see ``LocalServiceClient.stop_now``); True when none still
    computes. A second signal while waiting gives up the wait (False)."""
    if "rlrunbook.backend.service_client" not in sys.modules:
        return True  # no backend was ever made: nothing computes
    from rlrunbook.backend.service_client import stop_live_services

    try:
        return stop_live_services(timeout)
    except KeyboardInterrupt:
        return False


def finish_now(interrupt: KeyboardInterrupt) -> int:
    """A signal while :func:`finish` handled the first: leave at once with the first signal's status."""
    _exit_now(exit_code(interrupt))
    return exit_code(interrupt)  # not reached; os._exit does not return
