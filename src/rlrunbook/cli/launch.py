"""The ``rlrunbook`` console script (and ``python -m rlrunbook``): signal handlers first, then the command.

:func:`launch` installs the handlers of :mod:`rlrunbook.boundary.signals` before the command line's modules
are imported, so a signal in the first instant of start-up stops the command as one during it does; then the
allocator settings of a command that trains (:func:`rlrunbook.allocator.prepare`), which must precede any tensor.
"""

from __future__ import annotations

import signal
import sys

from rlrunbook import allocator, pending_signal
from rlrunbook.boundary.signals import STOP_SIGNALS, finish, finish_now, install, interrupted_by, unblock


def launch() -> int:
    """Run the command of ``sys.argv``; its exit status (see :func:`rlrunbook.cli.app.main`).

    A signal while the modules load ends the command as one during it does (``128 + N``, one line, no
    traceback). One that arrived while the signals were blocked (see :func:`~rlrunbook.boundary.signals.unblock`)
    is handled the same way, right after the handlers are in place. Once the command has returned, a late
    signal is ignored: its status stands.
    """
    install()
    try:
        try:
            unblock()
            allocator.prepare(sys.argv[1:])  # before any module allocates a tensor
            from rlrunbook.cli.app import main

            pending_signal.raise_pending()  # one that an imported module swallowed
            code = main()
        except KeyboardInterrupt as interrupt:
            code = finish(interrupt)
        except Exception as error:  # while the modules load: a library's error caused by a signal
            interrupt = interrupted_by(error)
            if interrupt is None:
                raise
            code = finish(interrupt)
        for name in ("SIGINT", *STOP_SIGNALS):
            number = getattr(signal, name, None)
            if number is not None:
                signal.signal(number, signal.SIG_IGN)
    except KeyboardInterrupt as again:  # a second signal while the first was handled, or one at the very end
        code = finish_now(again)
    return code
