"""The outcome classifier of the hostile-input run: pure, no process started, nothing read or written.

``classify`` turns one finished case (exit code, output, what the runner observed) into one outcome and the
message a user reads; ``output_lines``, ``warning_lines``, ``first_message`` and ``describe_exit`` read output
and exit codes as a terminal shows them. tests/unit/scripts/test_hostile_inputs.py checks it.

======================  ========================================================================  =======
outcome                 meaning                                                                   passes
======================  ========================================================================  =======
error                   exit 1 or 2 with a message and no traceback                               yes
accepted                exit 0 (or a train run that started and only failed its rubric)          yes
warned                  a "refuse or warn" case that ran and printed a warning line about it      yes
interrupted             a signal case that ended with exit 128+N                                 yes
before_start            a signal sent before rlrunbook's handlers existed (the interpreter was    yes
                        still starting) ended the process as the OS or Python does by default:
                        no rlrunbook code had run; ``env --block-signal`` closes that window
traceback               "Traceback (most recent call last)" anywhere in the output                no
bad_exit                an exit code other than 0, 1, 2 or 128+N of the signal sent              no
hang                    no exit within the case's time limit (killed)                             no
overwrite               a file of a prepared run that must not change changed or vanished         no
silent_accept           a "refuse or warn" case that ran without a warning line                   no
secret_written          a secret value reached a written file, a path or a package archive        no
misleading              refused, but with a message that names the wrong cause                    no
false_refusal           a case that must be accepted (a control, a documented form) was refused   no
no_message              exit 1 or 2 with no message at all                                        no
bad_state               after a signal the run still reads ``running`` (will show as stale)        no
missed_signal           a signal case that ended before its signal was sent: it tested nothing    no
======================  ========================================================================  =======
"""

from __future__ import annotations

import re
import signal

PASSING = ("error", "accepted", "warned", "interrupted", "before_start")
FAILING = ("traceback", "bad_exit", "hang", "overwrite", "silent_accept", "secret_written", "misleading",
           "false_refusal", "no_message", "bad_state", "missed_signal")
OUTCOMES = PASSING + FAILING

TRACEBACK = "Traceback (most recent call last)"
RUN_LINE = re.compile(r"^\[run\] ", re.M)
# "warning:" at the start of a line, optionally after a "[tag]"; not YAML such as "warn: 0.01" (show-config)
WARNING_LINE = re.compile(r"^\s*(?:\[[^\]]{1,40}\]\s*)?warning\b", re.I)
# Warnings that say nothing about the input of a case: the dynamic sampler skipping a step without spread.
NOISE_WARNING = re.compile(r"step \d+ skipped|no update: only", re.I)
PROGRESS = re.compile(r"^\s*(train|Loading weights|Writing model shards)[^\n]*\|")


def output_lines(output: str) -> list[str]:
    """Lines of the output as a terminal would show them: split on CR too, progress bars and blanks dropped."""
    lines = []
    for raw in re.split(r"\r\n|\r|\n", output):
        line = raw.strip()
        if line and not PROGRESS.match(line):
            lines.append(line)
    return lines


def warning_lines(output: str, words: tuple[str, ...] = ()) -> list[str]:
    """Warning lines about the input: ``warning: ...`` (optionally ``[tag] warning: ...``), not the dynamic
    sampler's step skips; with ``words``, only those that name one of them (case-insensitive)."""
    found = []
    for line in output_lines(output):
        if not WARNING_LINE.match(line) or NOISE_WARNING.search(line):
            continue
        if words and not any(w.lower() in line.lower() for w in words):
            continue
        found.append(line)
    return found


def first_message(output: str) -> str:
    """The line a user reads first: the exception of a traceback, else the first ``error`` line, else the last."""
    lines = output_lines(output)
    if not lines:
        return ""
    if TRACEBACK in output:
        tail = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", line)]
        if tail:
            return tail[-1]
    for line in lines:
        if re.match(r"^(error|fatal)\b", line, re.I) or line.startswith("rlrunbook: error"):
            return line
    return lines[-1]


def describe_exit(rc: int) -> str:
    """An exit code in words: a negative one names the signal that killed the process, 128+N the signal N."""
    if rc < 0:
        try:
            return f"exit {rc} (killed by {signal.Signals(-rc).name}, unhandled)"
        except ValueError:
            return f"exit {rc} (killed by signal {-rc})"
    if rc > 128:
        try:
            return f"exit {rc} (128+{signal.Signals(rc - 128).name})"
        except ValueError:
            return f"exit {rc}"
    return f"exit {rc}"


def classify(*, expect: str, rc: int | None, output: str, timed_out: bool = False, signum: int | None = None,
             stopped_at_run: bool = False, warn_words: tuple[str, ...] = (), bad_msg: str | None = None,
             changed: tuple[str, ...] = (), secrets: tuple[str, ...] = (), extra: tuple[str, str] | None = None,
             before_handlers: bool = False) -> tuple[str, str]:
    """Return (outcome, message) for one finished case.

    expect: ``no_crash`` (error or accepted both pass), ``accept`` (a refusal fails), ``refuse_or_warn``
    (running without a warning line fails), ``signal`` (exit 128+signum passes; a run that finished first is
    judged like ``no_crash``). ``stopped_at_run``: the harness killed a train run once it had started, which
    counts as accepted. ``bad_msg``: a regex that, found in a refusal, makes it misleading. ``extra``: an
    (outcome, message) of a case's own post-check, reported when nothing worse happened.
    ``before_handlers``: the signal was sent while the process had no handler for SIGTERM yet, i.e. before
    rlrunbook's first line ran; a default death then (killed by it, or Python's KeyboardInterrupt in its own
    start-up, nothing written) is ``before_start``.
    """
    msg = first_message(output)
    if timed_out:
        return "hang", f"no exit within the time limit; last line: {msg}"
    if before_handlers and signum is not None and not changed and not secrets and extra is None and (
            rc == -signum or (signum == signal.SIGINT and rc == 1
                              and output_lines(output)[-1:] == ["KeyboardInterrupt"])):
        return "before_start", f"{describe_exit(rc)} during the interpreter's start-up, before rlrunbook's handlers"
    if TRACEBACK in output:
        return "traceback", msg
    if changed:
        return "overwrite", "changed: " + ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
    if secrets:
        return "secret_written", "; ".join(secrets[:3])
    assert rc is not None
    handled = signum is not None and rc == 128 + signum
    if not handled and not stopped_at_run and rc not in (0, 1, 2):
        return "bad_exit", describe_exit(rc) + (f": {msg}" if msg else "")
    if extra is not None:
        return extra
    if handled:
        return "interrupted", msg or describe_exit(rc)
    ran = stopped_at_run or rc == 0 or (rc == 1 and RUN_LINE.search(output) is not None)
    if ran:
        warned = warning_lines(output, warn_words)
        if expect == "refuse_or_warn":
            if warned:
                return "warned", warned[0]
            return "silent_accept", "ran without a warning" + (" (stopped once started)" if stopped_at_run else
                                                               f" ({describe_exit(rc)})")
        return "accepted", (warned[0] if warned else msg)
    if not msg:
        return "no_message", describe_exit(rc) + " with no output"
    if bad_msg and re.search(bad_msg, output, re.I | re.M):
        return "misleading", msg
    if expect == "accept":
        return "false_refusal", msg
    return "error", msg
