"""The ``rlrunbook`` command.

    rlrunbook check-logprobs --model tiny --prompt "What is 7 * 8?" --max-tokens 32
    rlrunbook train --mode debate --env summary --reward-fn compression -n 16 --num-groups 2 -s 2 \
        --mock-judge --debate-train rs_grpo --debate-grpo-reward task --name mini
    rlrunbook check-run logs/<run>
    rlrunbook train ... --checkpoint-every 2; rlrunbook train --resume-from logs/<run> -s 8
    rlrunbook eval-checkpoints logs/<run> --samples 8 --ks 1 4 8 --out table.csv
    rlrunbook resolve-model smollm2-135m
    rlrunbook bench-history --png trend.png
    rlrunbook serve --port 8000 --api-key tml-...
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from rlrunbook import pending_signal
from rlrunbook.boundary import reporting, signals
from rlrunbook.cli import check_logprobs, cookbook, evaluation, runs, serve, tools, train
from rlrunbook.cli.arguments import is_number
from rlrunbook.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse, reading every negative number as a value: ``--learning-rate -1e-4`` or ``--temperature -inf`` is
    then refused by the option's own check, naming the value, instead of "expected one argument" (argparse
    takes only ``-1`` and ``-.5`` for numbers, and ``-1e-4``, ``-inf`` for options)."""

    def _parse_optional(self, arg_string):
        if arg_string.startswith("-") and arg_string not in self._option_string_actions and is_number(arg_string):
            return None  # a value (argparse's own answer for the numbers it recognises)
        return super()._parse_optional(arg_string)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlrunbook", description="RL post-training of LoRA policies behind the "
                                     "Tinker API, checked by an executable runbook.")
    commands = parser.add_subparsers(dest="command", required=True)
    check_logprobs.add_command(commands)
    train.add_commands(commands)
    runs.add_commands(commands)
    evaluation.add_commands(commands)
    serve.add_command(commands)
    cookbook.add_command(commands)
    tools.add_commands(commands)
    return parser


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")



def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; ``key.sub=value`` overrides of train/show-config may sit anywhere among the flags."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not hasattr(args, "overrides") or not all(_OVERRIDE.match(item) for item in extras):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*args.overrides, *extras]
    return args


def _check_text(argv: Sequence[str]) -> None:
    """``ConfigError`` naming the argument when one holds bytes that are not UTF-8 (Python passes them on as lone
    surrogates, which no file of a run can record and no tokenizer can read)."""
    for position, value in enumerate(argv, start=1):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raw = value.encode("utf-8", "surrogateescape")[error.start:error.start + 1]
            raise ConfigError(f"argument {position} ({value!r}) is not UTF-8 text (byte 0x{raw.hex()} at offset "
                              f"{error.start}). Pass it as UTF-8 (rename a file whose name is in another "
                              "encoding, e.g. with `convmv -f latin1 -t utf-8`).") from None


def _run(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its command; an anticipated error becomes one paragraph (exit 2), any other
    exception a bug report (exit 70): see :mod:`rlrunbook.boundary.reporting`."""
    try:
        _check_text(sys.argv[1:] if argv is None else argv)
        args = parse_args(argv)
        pending_signal.raise_pending()  # a signal that a module imported so far swallowed
        if argv is not None and getattr(args, "argv", False) is None:
            args.argv = list(argv)  # an in-process caller's command line is what the run records, not sys.argv
        return args.func(args)
    except BrokenPipeError:
        # `rlrunbook summarize ... | head`: the reader left. Point stdout at nothing so the exit flushes quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # as if killed by SIGPIPE, what a shell reports for the other commands of a pipe
    except Exception as error:  # noqa: BLE001 - the boundary: anticipated classes are described, the rest reported
        interrupt = signals.interrupted_by(error)
        if interrupt is not None:  # a signal's KeyboardInterrupt that a library turned into its own error
            raise interrupt from error
        message = reporting.describe(error)
        return reporting.refuse(message) if message is not None else reporting.report_bug(error)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``rlrunbook`` command; its exit status (docs/cli.md): 0 success, 1 its check failed, 2 refused
    (one ``error:`` paragraph), 70 a bug (a traceback and where to report it), 128 + N after signal N.

    SIGTERM and SIGHUP are handled from this function's first line, Ctrl-C as Python does from start-up: each
    stops the command as Ctrl-C does (see :mod:`rlrunbook.boundary.signals`), without a traceback.
    """
    pending_signal.acknowledge()  # what an earlier command of this process left is not this command's
    restore = signals.install()
    try:
        try:
            return _run(argv)
        except KeyboardInterrupt as interrupt:
            return signals.finish(interrupt)
    except KeyboardInterrupt as again:  # a second signal while the first was being handled
        return signals.finish_now(again)
    finally:
        restore()

