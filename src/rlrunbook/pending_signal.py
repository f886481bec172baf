"""The signals a command has received and not yet acted on, for every layer to check.

A signal handler raises ``KeyboardInterrupt`` wherever the main thread happens to be. A library may swallow
it there (a bare ``except:`` while a module imports) or turn it into an error of its own (transformers' lazy
imports raise ``ModuleNotFoundError``), and the command would go on as if nothing had been sent.
:mod:`rlrunbook.boundary.signals`' handlers therefore also record each signal here; :func:`raise_pending` at the
points where work begins (a command starts, a model loads, a training step starts) raises it again, and the
error boundaries ask :func:`pending` whether an error is a signal's consequence. Once an interrupt reaches
its handler (``boundary.signals.finish``) the record is cleared.
"""

from __future__ import annotations

_received: list[str] = []


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so a command stops as cleanly as on Ctrl-C."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def record(signal_name: str) -> None:
    """A handler received ``signal_name`` (``SIGINT``, ``SIGTERM``, ``SIGHUP``)."""
    _received.append(signal_name)


def pending() -> KeyboardInterrupt | None:
    """The interrupt of the first signal received and not yet acted on, or None."""
    if not _received:
        return None
    return KeyboardInterrupt() if _received[0] == "SIGINT" else Stopped(_received[0])


def acknowledge() -> None:
    """The interrupt reached its handler: nothing is pending any more."""
    _received.clear()


def raise_pending() -> None:
    """Raise the interrupt of a signal that was received but swallowed before it could stop the command."""
    interrupt = pending()
    if interrupt is not None:
        raise interrupt
