#!/usr/bin/env python3
"""Hostile-input run: hundreds of bad, contradictory or malicious inputs against the installed ``rlrunbook``.

Every case runs the command as a user types it, in a fresh temporary folder of its own (HOME, working folder,
``TINKER_LOCAL_STORAGE``, ``RLRUNBOOK_CACHE_DIR``, ``RLRUNBOOK_LOG_ROOT``, an empty ``RLRUNBOOK_DATA_DIR``, the
Hugging Face caches, offline), on the built-in ``tiny`` model, under a time limit, and is classified:

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

Usage::

    python scripts/hostile_inputs.py                       # against ./.venv/bin/rlrunbook, 2 workers
    python scripts/hostile_inputs.py /path/to/.venv -j 2 --json /tmp/hostile.json
    python scripts/hostile_inputs.py --only signals --only secrets
    python scripts/hostile_inputs.py --list                # the cases, no run

Exit 0 when every case passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import gzip
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent

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

# --- the classifier (pure; tests/unit/scripts/test_hostile_inputs.py) -----------------------------------


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
            rc == -signum or (signum == signal.SIGINT and rc == 1 and output_lines(output)[-1:] == ["KeyboardInterrupt"])):
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


# --- cases ---------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    root: Path  # the case's own folder
    home: Path
    work: Path  # working folder (cwd)
    logs: Path
    store: Path
    cache: Path
    run: Path | None = None  # copy of the prepared run directory
    data: Path | None = None

    def fmt(self, s: str) -> str:
        return s.format(root=self.root, home=self.home, work=self.work, logs=self.logs, store=self.store,
                        cache=self.cache, run=self.run, ck1=(self.run / "checkpoints" / "step_000001") if self.run
                        else "", ck2=(self.run / "checkpoints" / "step_000002") if self.run else "")


@dataclass
class Case:
    id: str
    cls: str
    argv: list  # rlrunbook arguments; str items are .format()ed with Ctx fields, bytes passed as they are
    expect: str = "no_crash"
    env: dict = field(default_factory=dict)
    unset: tuple = ()  # variables of the base environment to remove
    setup: Callable[[Ctx], None] | None = None
    needs_run: bool = False
    protect: tuple = ()  # paths (formatted) whose files must not change; needs_run adds the run directory
    stop_at_run: bool = False
    timeout: float | None = None
    sig: tuple | None = None  # (signum, seconds) or (signum, regex, delay)
    blocked: bool = False  # start with SIGINT/SIGTERM/SIGHUP blocked, as `env --block-signal` does
    warn_words: tuple = ()
    bad_msg: str | None = None
    secret: str | None = None  # must not appear in any file written under logs/ or store/, nor a path name
    post: Callable[[Ctx, str], tuple[str, str] | None] | None = None
    note: str = ""


def w(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    path.write_bytes(data)
    return path


# Cheap train: the tiny-cpu-smoke preset (tiny model, generated news, compression reward), one step.
T = ["train", "--config-file", "tiny-cpu-smoke", "steps=1", "num_rollouts=4", "max_tokens=8", "checkpoint.every=0"]
# A train that runs for minutes (a signal 2 s in lands mid-step): 200 steps with enough rows and tokens a step
# that rewards vary within groups (fewer stop on "no learning signal" after 3 steps).
T_LONG = [{"steps=1": "steps=200", "num_rollouts=4": "num_rollouts=8", "max_tokens=8": "max_tokens=32",
           "checkpoint.every=0": "checkpoint.every=1"}.get(a, a)
          for a in T]
TQA = ["train", "--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "4", "-s", "1", "--max-tokens", "8"]
EVAL = ["eval", "--model", "tiny", "--num-problems", "2", "--samples", "2", "--ks", "1", "--max-tokens", "4",
        "--resamples", "50"]
# An eval that samples for tens of seconds on tiny: a signal 0.3 s after it starts lands while it samples.
EVAL_MID = EVAL[:4] + ["64", "--samples", "8", "--ks", "1", "--max-tokens", "64"]
EVAL_CK = ["eval-checkpoints", "--samples", "2", "--num-problems", "2", "--ks", "1", "--resamples", "50"]


def qa_rows(n: int = 8) -> str:
    return "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i}+{i} = {2 * i}\n#### {2 * i}"}) + "\n"
                   for i in range(1, n + 1))


def data_case(cid: str, content: str | bytes | Callable[[], bytes], *, expect="no_crash", bad_msg=None,
              env="qa", warn_words=(), timeout=None, stop_at_run=False) -> Case:
    def setup(ctx: Ctx) -> None:
        body = content() if callable(content) else content
        w(ctx.work / "data.jsonl", body)
    argv = ["train", "--model", "tiny", "--env", env, "--dataset", "{work}/data.jsonl", "-n", "4", "-s", "1",
            "--max-tokens", "8"]
    return Case(cid, "", argv, expect=expect, setup=setup, bad_msg=bad_msg, warn_words=warn_words,
                timeout=timeout, stop_at_run=stop_at_run)


def yaml_case(cid: str, text: str | bytes, *, expect="no_crash", warn_words=(), cmd="train", stop_at_run=False,
              bad_msg=None) -> Case:
    def setup(ctx: Ctx) -> None:
        w(ctx.work / "cfg.yaml", text)
    argv = ([cmd, "--config-file", "{work}/cfg.yaml"] + (["--model", "tiny"] if cmd == "train" else []))
    return Case(cid, "", argv, expect=expect, setup=setup, warn_words=warn_words, stop_at_run=stop_at_run,
                bad_msg=bad_msg)


def make_immutable(path: Path) -> bool:
    """Root ignores permission bits; the immutable attribute stops it. False where chattr cannot."""
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def make_mutable(path: Path) -> None:
    if shutil.which("chattr"):
        subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)


def readonly_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
    elif not make_immutable(path):
        raise RuntimeError(f"cannot make {path} unwritable for root (no chattr +i on this file system)")


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=1))


def archive_has(name_re: str) -> Callable[[Ctx, str], tuple[str, str] | None]:
    """Post-check of a package case: an archive was made and holds a member whose name matches."""
    def check(ctx: Ctx, output: str) -> tuple[str, str] | None:
        for arch in list(ctx.root.rglob("*.tar.gz")):
            try:
                with tarfile.open(arch) as tar:
                    names = tar.getnames()
            except (tarfile.TarError, OSError):
                continue
            hits = [n for n in names if re.search(name_re, n)]
            if hits:
                return "secret_written", f"{arch.name} holds {hits[0]}"
        return None
    return check


def run_status_check(ctx: Ctx, output: str) -> tuple[str, str] | None:
    """After a signal: a run directory whose record still says running will show as stale."""
    for meta in ctx.logs.rglob("run_metadata.json") if ctx.logs.exists() else []:
        if ctx.run is not None and meta.parent == ctx.run:
            continue
        try:
            status = json.loads(meta.read_text()).get("status")
        except (OSError, ValueError):
            return "bad_state", f"{meta.parent.name}: run_metadata.json unreadable after the signal"
        if status == "running":
            return "bad_state", f"{meta.parent.name}: status still 'running' after the process ended"
    return None


def lr_trusted_check(ctx: Ctx, output: str) -> tuple[str, str] | None:
    """Resume with a flipped learning-rate digit in checkpoint.json: refused, warned, or the original used."""
    for meta in ctx.logs.rglob("run_metadata.json"):
        if meta.parent == ctx.run:
            continue
        try:
            lr = json.loads(meta.read_text())["config"]["learning_rate"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if lr == 0.009 and not warning_lines(output, ("checksum", "checkpoint.json", "corrupt", "tamper")):
            return "silent_accept", "resumed with the corrupted learning rate 0.009 (the run's was 0.001)"
    return None


def cases() -> list[Case]:  # noqa: C901 - one long table, by class
    out: list[Case] = []

    def add(cls: str, *items: Case) -> None:
        for c in items:
            c.cls = cls
            out.append(c)

    # --- controls: must be accepted ------------------------------------------------------------------------
    add("controls",
        Case("ctl-train-preset", "", [a for a in T if not a.startswith("checkpoint.every=")] + ["checkpoint.every=1"],
             expect="accept", timeout=300),
        Case("ctl-train-qa", "", TQA + ["--num-groups", "2"], expect="accept", stop_at_run=True),
        Case("ctl-show-config", "", ["show-config", "--config-file", "tiny-cpu-smoke"], expect="accept"),
        Case("ctl-resolve-model", "", ["resolve-model", "tiny"], expect="accept"),
        Case("ctl-eval", "", EVAL, expect="accept"),
        Case("ctl-check-run", "", ["check-run", "{run}"], expect="accept", needs_run=True),
        Case("ctl-summarize", "", ["summarize", "{run}"], expect="accept", needs_run=True),
        Case("ctl-package", "", ["package", "{run}", "--out", "{work}/run.tar.gz"], expect="accept",
             needs_run=True),
        Case("ctl-resume", "", ["train", "--resume-from", "{ck1}"], expect="accept", needs_run=True, timeout=300),
        Case("ctl-jsonl-data", "", ["train", "--model", "tiny", "--env", "math", "--dataset", "{work}/data.jsonl",
                                    "-n", "4", "-s", "1", "--max-tokens", "8"], expect="accept",
             setup=lambda c: w(c.work / "data.jsonl", qa_rows()), stop_at_run=True),
        Case("ctl-unicode-name", "", TQA + ["--name", "résumé-測試"], expect="accept", stop_at_run=True),
        Case("ctl-eval-checkpoints", "", EVAL_CK + ["{run}"], expect="accept", needs_run=True, timeout=240),
        )

    # --- numbers beyond limits ----------------------------------------------------------------------------
    big = str(10 ** 23)
    add("limits",
        Case("seed-1e23", "", TQA + ["--seed", big]),
        Case("seed-2**63", "", TQA + ["--seed", str(2 ** 63)]),
        Case("seed-2**64", "", TQA + ["--seed", str(2 ** 64)]),
        Case("seed-5001-digits", "", TQA + ["--seed", "9" * 5001]),
        Case("n-1e20", "", TQA[:-6] + ["-n", str(10 ** 20), "-s", "1", "--max-tokens", "8"], timeout=120),
        Case("n-2**31", "", TQA[:-6] + ["-n", str(2 ** 31), "-s", "1", "--max-tokens", "8"], timeout=120),
        Case("steps-1e20", "", TQA[:-4] + ["-s", str(10 ** 20), "--max-tokens", "8"], timeout=120),
        Case("max-tokens-1e12", "", TQA[:-2] + ["--max-tokens", str(10 ** 12)], timeout=120),
        Case("lora-rank-1e9", "", TQA + ["--lora-rank", str(10 ** 9)], timeout=120),
        Case("num-groups-1e20", "", TQA + ["--num-groups", str(10 ** 20)]),
        Case("temperature-1e400", "", TQA + ["--temperature", "1e400"]),
        Case("temperature-nan", "", TQA + ["--temperature", "nan"]),
        Case("lr-inf", "", TQA + ["--learning-rate", "inf"]),
        Case("kl-coef-1e308", "", TQA + ["--kl-coef", "1e308"], stop_at_run=True),
        Case("checkpoint-every-1e30", "", TQA + ["--checkpoint-every", str(10 ** 30)]),
        Case("val-samples-1e20", "", TQA + ["--val-every", "1", "--val-samples", str(10 ** 20)], timeout=120),
        Case("max-prompt-tokens-1e25", "", TQA + ["--max-prompt-tokens", str(10 ** 25)], timeout=120),
        Case("override-steps-5001-digits", "", TQA[:-4] + ["--max-tokens", "8", "steps=" + "1" * 5001]),
        Case("override-test-size-1e20", "", TQA + ["extra.test_size=" + str(10 ** 20)], timeout=120),
        Case("eval-samples-1e20", "", EVAL + ["--samples", str(10 ** 20)], timeout=120),
        Case("eval-resamples-1e20", "", EVAL + ["--resamples", str(10 ** 20)], timeout=120),
        Case("eval-ks-1e20", "", EVAL[:-4] + ["--ks", str(10 ** 20), "--resamples", "50"]),
        Case("eval-seed-1e23", "", EVAL + ["--seed", big]),
        Case("eval-num-problems-1e20", "", EVAL[:2] + ["--num-problems", str(10 ** 20), "--samples", "1",
                                                       "--ks", "1", "--max-tokens", "4"], timeout=120),
        Case("check-logprobs-seed-1e23", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4",
                                              "--num-samples", "1", "--seed", big]),
        Case("check-logprobs-samples-1e20", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4",
                                                 "--num-samples", str(10 ** 20)], timeout=120),
        Case("yaml-steps-1e30", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", f"steps: {10 ** 30}\nnum_rollouts: 4\n"), timeout=120),
        )
    lim = [
        data_case("data-5001-digit-answer", json.dumps({"question": "q?", "answer": "#### " + "7" * 5001}) + "\n"
                  + qa_rows(4)),
        data_case("data-5001-digit-int-field", '{"question": "q?", "answer": "#### 4", "id": ' + "9" * 5001 + "}\n"
                  + qa_rows(4)),
        data_case("data-nested-100000", lambda: ('{"question": "q?", "answer": "#### 4", "x": ' + "[" * 100000
                                                 + "]" * 100000 + "}\n" + qa_rows(4)).encode()),
        data_case("data-nested-objects-50000", lambda: ('{"question": "q?", "answer": "#### 4", "x": '
                                                        + '{"a":' * 50000 + "1" + "}" * 50000 + "}\n"
                                                        + qa_rows(4)).encode()),
        data_case("data-huge-line-64MB", lambda: (qa_rows(4) + '{"question": "' + "x" * (64 << 20)
                                                  + '", "answer": "#### 4"}\n').encode(), timeout=180),
        data_case("data-huge-line-no-newline-64MB", lambda: b"{" + b" " * (64 << 20), timeout=180),
        data_case("data-float-1e400", '{"question": "q?", "answer": "#### 1e400"}\n' + qa_rows(4)),
        data_case("data-NaN-literal", '{"question": "q?", "answer": NaN}\n' + qa_rows(4)),
        data_case("data-1M-rows", lambda: qa_rows(1) * 1_000_000, timeout=180),
        data_case("summary-article-8MB", json.dumps({"id": "a", "article": "word " * (2 << 20),
                                                     "highlights": "x."}) + "\n", env="summary", timeout=180),
    ]
    add("limits", *lim)

    # --- file-system states --------------------------------------------------------------------------------
    def file_at(rel: str) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            p = ctx.root / rel
            if p.is_dir():
                shutil.rmtree(p)
            w(p, "not a directory\n")
        return setup

    def ro_at(rel: str, keep_cache: bool = True) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            readonly_dir(ctx.root / rel)
        return setup

    add("filesystem",
        Case("storage-is-file", "", TQA, env={"TINKER_LOCAL_STORAGE": "{root}/storefile"},
             setup=file_at("storefile")),
        Case("storage-readonly", "", TQA, env={"TINKER_LOCAL_STORAGE": "{root}/rostore"}, setup=ro_at("rostore")),
        Case("storage-under-file", "", TQA, env={"TINKER_LOCAL_STORAGE": "{root}/storefile/sub"},
             setup=file_at("storefile")),
        Case("cache-is-file", "", TQA, env={"RLRUNBOOK_CACHE_DIR": "{root}/cachefile"}, setup=file_at("cachefile")),
        Case("cache-readonly-empty", "", TQA, env={"RLRUNBOOK_CACHE_DIR": "{root}/rocache"},
             setup=ro_at("rocache")),
        Case("cache-under-file", "", TQA, env={"RLRUNBOOK_CACHE_DIR": "{root}/cachefile/sub"},
             setup=file_at("cachefile")),
        Case("cache-readonly-dataset-cache", "", TQA + ["--cache-dataset"],
             setup=lambda c: readonly_dir(c.cache / "datasets")),
        Case("cache-models-is-file", "", TQA, setup=lambda c: (shutil.rmtree(c.cache / "models", True),
                                                                w(c.cache / "models", "x"))),
        Case("log-root-readonly", "", TQA + ["--log-root", "{root}/rologs"], setup=ro_at("rologs")),
        Case("log-root-is-file", "", TQA + ["--log-root", "{root}/logfile"], setup=file_at("logfile")),
        Case("log-root-env-is-file", "", TQA, env={"RLRUNBOOK_LOG_ROOT": "{root}/logfile"},
             setup=file_at("logfile")),
        Case("cwd-readonly-default-logs", "", TQA, unset=("RLRUNBOOK_LOG_ROOT",),
             setup=lambda c: readonly_dir(c.work)),
        Case("home-is-file", "", TQA, env={"HOME": "{root}/homefile"}, unset=("XDG_CACHE_HOME", "MPLCONFIGDIR"),
             setup=file_at("homefile")),
        Case("tmpdir-readonly", "", TQA, env={"TMPDIR": "{root}/rotmp"}, setup=ro_at("rotmp"), stop_at_run=True),
        Case("package-out-readonly", "", ["package", "{run}", "--out", "{root}/roout/run.tar.gz"], needs_run=True,
             setup=ro_at("roout")),
        Case("package-out-parent-file", "", ["package", "{run}", "--out", "{root}/pfile/run.tar.gz"],
             needs_run=True, setup=file_at("pfile")),
        Case("package-out-is-dir", "", ["package", "{run}", "--out", "{work}"], needs_run=True),
        Case("package-run-readonly-default-out", "", ["package", "{run}"], needs_run=True,
             setup=lambda c: make_immutable(c.logs)),
        Case("eval-out-parent-file", "", EVAL + ["--out", "{root}/pfile/e.json"], setup=file_at("pfile")),
        Case("eval-out-readonly", "", EVAL + ["--out", "{root}/roout/e.json"], setup=ro_at("roout")),
        Case("eval-out-is-dir", "", EVAL + ["--out", "{work}"]),
        Case("summarize-out-parent-file", "", ["summarize", "{run}", "--out", "{root}/pfile/t.csv"],
             needs_run=True, setup=file_at("pfile")),
        Case("summarize-out-readonly", "", ["summarize", "{run}", "--out", "{root}/roout/t.md"], needs_run=True,
             setup=ro_at("roout")),
        Case("summarize-out-bad-suffix", "", ["summarize", "{run}", "--out", "{work}/t.xlsx"], needs_run=True),
        Case("eval-checkpoints-out-parent-file", "", EVAL_CK + ["{run}", "--out", "{root}/pfile/t.csv"],
             needs_run=True, setup=file_at("pfile"), timeout=240),
        Case("check-run-missing", "", ["check-run", "{root}/nope"]),
        Case("check-run-a-file", "", ["check-run", "{root}/f"], setup=lambda c: w(c.root / "f", "x")),
        Case("summarize-unreadable-dir", "", ["summarize", "{root}/emptyrun"],
             setup=lambda c: (c.root / "emptyrun").mkdir()),
        Case("resume-from-missing", "", ["train", "--resume-from", "{root}/nope"]),
        Case("resume-from-a-file", "", ["train", "--resume-from", "{root}/f"], setup=lambda c: w(c.root / "f", "x")),
        Case("config-file-is-dir", "", ["train", "--config-file", "{work}", "--model", "tiny"]),
        Case("config-file-fifo", "", ["train", "--config-file", "{work}/fifo", "--model", "tiny"],
             setup=lambda c: os.mkfifo(c.work / "fifo"), timeout=60),
        Case("dataset-dev-zero", "", TQA[:6] + ["/dev/zero"] + TQA[7:], timeout=90),
        Case("dataset-is-fifo", "", TQA[:6] + ["{work}/fifo.jsonl"] + TQA[7:],
             setup=lambda c: os.mkfifo(c.work / "fifo.jsonl"), timeout=60),
        Case("dataset-dir-two-jsonl", "", TQA[:6] + ["{work}/d"] + TQA[7:],
             setup=lambda c: (w(c.work / "d/a.jsonl", qa_rows()), w(c.work / "d/b.jsonl", qa_rows()))),
        Case("storage-store-file-corrupt", "", ["eval", "--weights", "tinker://local-0000/sampler_weights/x"]
             + EVAL[3:]),
        )

    # --- broken model folders ------------------------------------------------------------------------------
    def model_dir(mutate: Callable[[Path], None]) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            src = next((ctx.cache / "models").glob("tiny*"))
            dst = ctx.work / "m"
            shutil.copytree(src, dst)
            mutate(dst)
        return setup

    def hdr(n: int, body: bytes) -> bytes:
        return n.to_bytes(8, "little") + body

    broken = {
        "config-not-json": lambda d: w(d / "config.json", "{not json"),
        "config-empty": lambda d: w(d / "config.json", ""),
        "config-list": lambda d: w(d / "config.json", "[1, 2]"),
        "config-not-utf8": lambda d: w(d / "config.json", b'{"model_type": "\xff\xfe"}'),
        "config-unknown-model-type": lambda d: edit_json(d / "config.json", lambda c: c.update(model_type="nope")),
        "config-missing": lambda d: (d / "config.json").unlink(),
        "config-vocab-negative": lambda d: edit_json(d / "config.json", lambda c: c.update(vocab_size=-5)),
        "config-hidden-1e12": lambda d: edit_json(d / "config.json", lambda c: c.update(hidden_size=10 ** 12)),
        "safetensors-bad-header": lambda d: w(d / "model.safetensors", hdr(20, b"{not a json header!!")),
        "safetensors-huge-header-len": lambda d: w(d / "model.safetensors", hdr(2 ** 62, b"{}")),
        "safetensors-truncated": lambda d: w(d / "model.safetensors", (d / "model.safetensors").read_bytes()[:4096]),
        "safetensors-empty": lambda d: w(d / "model.safetensors", b""),
        "safetensors-missing": lambda d: (d / "model.safetensors").unlink(),
        "tokenizer-not-json": lambda d: w(d / "tokenizer.json", "{oops"),
        "tokenizer-missing": lambda d: (d / "tokenizer.json").unlink(),
        "tokenizer-config-not-json": lambda d: w(d / "tokenizer_config.json", "]["),
        "generation-config-not-json": lambda d: w(d / "generation_config.json", "nope"),
    }
    for name, mut in broken.items():
        add("model-folder", Case(f"model-{name}", "", ["train", "--model", "{work}/m"] + TQA[3:],
                                 setup=model_dir(mut), timeout=120))
    add("model-folder",
        Case("model-eval-config-not-json", "", ["eval", "--model", "{work}/m"] + EVAL[3:],
             setup=model_dir(broken["config-not-json"])),
        Case("model-eval-safetensors-bad", "", ["eval", "--model", "{work}/m"] + EVAL[3:],
             setup=model_dir(broken["safetensors-bad-header"])),
        Case("model-resolve-empty-dir", "", ["resolve-model", "{work}/m"], setup=lambda c: (c.work / "m").mkdir()),
        Case("model-check-logprobs-bad-header", "", ["check-logprobs", "--model", "{work}/m", "--max-tokens", "4",
                                                     "--num-samples", "1"],
             setup=model_dir(broken["safetensors-bad-header"])),
        Case("model-builtin-cache-corrupt", "", TQA,
             setup=lambda c: w(next((c.cache / "models").glob("tiny*")) / "config.json", "{broken")),
        Case("model-builtin-cache-safetensors-corrupt", "", TQA,
             setup=lambda c: w(next((c.cache / "models").glob("tiny*")) / "model.safetensors", hdr(9, b"{garbage}"))),
        )

    # --- encodings -----------------------------------------------------------------------------------------
    add("encoding",
        Case("arg-name-non-utf8", "", TQA + [b"--name", b"bad\xff\xfename"]),
        Case("arg-name-surrogate-bytes", "", TQA + [b"--name", b"x\xed\xa0\x80y"]),
        Case("arg-dataset-non-utf8-path", "", TQA[:6] + [b"/tmp/no\xffsuch.jsonl"] + TQA[7:]),
        Case("arg-override-non-utf8", "", TQA + [b"extra.note=\xff"], stop_at_run=True),
        Case("arg-model-non-utf8", "", ["train", "--model", b"ti\xffny"] + TQA[3:]),
        Case("arg-config-file-non-utf8-name", "", ["train", "--config-file", b"/tmp/c\xff.yaml", "--model", "tiny"]),
        Case("arg-log-root-non-utf8", "", TQA + [b"--log-root", b"{root}/l\xffogs"]),
        Case("arg-eval-out-non-utf8", "", EVAL + [b"--out", b"/tmp/e\xff.json"]),
        Case("arg-summarize-non-utf8-run", "", ["summarize", b"/tmp/r\xffun"]),
        Case("arg-package-non-utf8-run", "", ["package", b"/tmp/r\xffun"]),
        Case("arg-check-run-non-utf8", "", ["check-run", b"/tmp/r\xffun"]),
        Case("arg-resolve-model-non-utf8", "", ["resolve-model", b"m\xff"]),
        Case("arg-check-logprobs-prompt-non-utf8", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4",
                                                        "--num-samples", "1", "--prompt", b"What \xff is 2+2?"]),
        Case("arg-blocklist-non-utf8", "", TQA + [b"--blocklist", b"\xff\xfe"], stop_at_run=True),
        Case("env-log-root-non-utf8", "", TQA, env={"RLRUNBOOK_LOG_ROOT": b"{root}/l\xffogs"}),
        Case("env-storage-non-utf8", "", TQA, env={"TINKER_LOCAL_STORAGE": b"{root}/s\xfftore"}),
        Case("env-ascii-stdout-unicode-name", "", TQA + ["--name", "日本語"], env={"PYTHONIOENCODING": "ascii"},
             stop_at_run=True),
        Case("env-lc-all-c-unicode-name", "", TQA + ["--name", "日本語"], env={"LC_ALL": "C", "LANG": "C",
                                                                              "PYTHONUTF8": "0"}, stop_at_run=True),
        Case("yaml-non-utf8", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", b"name: caf\xe9\nsteps: 1\n")),
        Case("yaml-lone-surrogate-escape", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", 'name: "x\\ud800y"\nsteps: 1\nnum_rollouts: 4\n')),
        Case("yaml-utf16-bom", "", ["show-config", "--config-file", "{work}/cfg.yaml"],
             setup=lambda c: w(c.work / "cfg.yaml", "steps: 1\n".encode("utf-16"))),
        data_case("data-non-utf8-row", b'{"question": "caf\xe9?", "answer": "#### 4"}\n' + qa_rows(4).encode()),
        data_case("data-lone-surrogate-escape", '{"question": "x\\ud800y?", "answer": "#### 4"}\n' + qa_rows(4)),
        data_case("data-raw-surrogate-bytes", b'{"question": "x\xed\xa0\x80?", "answer": "#### 4"}\n'
                  + qa_rows(4).encode()),
        data_case("data-utf16", qa_rows(4).encode("utf-16")),
        data_case("data-utf8-bom", b"\xef\xbb\xbf" + qa_rows(4).encode(), stop_at_run=True),
        data_case("data-nul-bytes", b"\x00" * 100 + qa_rows(4).encode()),
        data_case("data-latin1-file", qa_rows(4).replace("What", "Qu\u00e9").encode("latin-1")),
        )

    # --- YAML ----------------------------------------------------------------------------------------------
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)) + "extra:\n  bomb: *i\n"
    add("yaml",
        yaml_case("sweep-numeric-key", "sweep:\n  1: [a, b]\nsteps: 1\n"),
        yaml_case("sweep-null-key", "sweep:\n  ~: [1, 2]\n"),
        yaml_case("sweep-list-key", "sweep:\n  [a, b]: [1, 2]\n"),
        yaml_case("sweep-not-mapping", "sweep: 5\n"),
        yaml_case("alias-bomb", bomb, cmd="train"),
        yaml_case("alias-bomb-show-config", bomb, cmd="show-config"),
        yaml_case("alias-bomb-in-sweep", bomb.replace("extra:\n  bomb: *i\n", "sweep:\n  seed: *i\n"),
                  cmd="show-config"),
        yaml_case("yaml-top-level-list", "- 1\n- 2\n"),
        yaml_case("yaml-top-level-scalar", "hello\n"),
        yaml_case("yaml-empty", ""),
        yaml_case("yaml-python-tag", "name: !!python/object/apply:os.system ['true']\n"),
        yaml_case("yaml-binary-tag", "name: !!binary aGVsbG8=\n"),
        yaml_case("yaml-steps-true", "steps: true\nnum_rollouts: 4\nmax_tokens: 8\n", expect="refuse_or_warn",
                  stop_at_run=True, warn_words=("steps",)),
        yaml_case("yaml-seed-float", "seed: 1.5\n"),
        yaml_case("yaml-duplicate-key", "steps: 1\nsteps: 2\nnum_rollouts: 4\nmax_tokens: 8\n",
                  expect="refuse_or_warn", stop_at_run=True, warn_words=("steps", "duplicate")),
        yaml_case("yaml-deep-nesting", "extra: " + "[" * 5000 + "]" * 5000 + "\n"),
        yaml_case("yaml-huge-int", "seed: " + "9" * 5001 + "\n"),
        yaml_case("yaml-merge-key-loop", "a: &a\n  <<: *a\n"),
        yaml_case("yaml-tab-indent", "loss:\n\tkl_coef: 1\n"),
        yaml_case("yaml-unknown-top-key", "stepz: 3\n", expect="no_crash"),
        yaml_case("yaml-version-99", "version: 99\n"),
        yaml_case("yaml-sweep-empty-list", "sweep:\n  seed: []\n"),
        yaml_case("yaml-sweep-repeated-point", "sweep:\n  seed: [1, 1]\nsteps: 1\nnum_rollouts: 4\nmax_tokens: 8\n",
                  expect="refuse_or_warn", cmd="show-config", warn_words=("sweep", "repeat", "duplicate")),
        )

    # --- resume with corrupted files -----------------------------------------------------------------------
    def corrupt(rel: str, fn: Callable[[Path], None]) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            fn(ctx.run / rel)
        return setup

    ck = "checkpoints/step_000001/"
    resume = {
        "checkpoint-json-not-json": (ck + "checkpoint.json", lambda p: w(p, "{oops")),
        "checkpoint-json-empty": (ck + "checkpoint.json", lambda p: w(p, "")),
        "checkpoint-json-no-has-optimizer": (ck + "checkpoint.json", lambda p: edit_json(p, lambda d: d.pop("has_optimizer"))),
        "checkpoint-json-no-config": (ck + "checkpoint.json", lambda p: edit_json(p, lambda d: d.pop("config"))),
        "checkpoint-json-step-string": (ck + "checkpoint.json", lambda p: edit_json(p, lambda d: d.update(step="x"))),
        "checkpoint-json-cursor-negative": (ck + "checkpoint.json", lambda p: edit_json(
            p, lambda d: d["data_cursor"].update(next_problem=-5))),
        "checkpoint-json-list": (ck + "checkpoint.json", lambda p: w(p, "[]")),
        "checkpoint-json-missing": (ck + "checkpoint.json", lambda p: p.unlink()),
        "rng-json-no-python": ("checkpoints/step_000002/rng.json", lambda p: edit_json(p, lambda d: d.pop("python", None))),
        "rng-json-not-json": ("checkpoints/step_000002/rng.json", lambda p: w(p, "nope")),
        "rng-json-bad-value": ("checkpoints/step_000002/rng.json", lambda p: edit_json(
            p, lambda d: d.update({k: "garbage" for k in list(d)}))),
        "rng-safetensors-truncated": ("checkpoints/step_000002/rng.safetensors", lambda p: w(p, p.read_bytes()[:50])),
        "adapter-truncated": ("checkpoints/step_000002/adapter.safetensors", lambda p: w(p, p.read_bytes()[:100])),
        "optimizer-garbage": ("checkpoints/step_000002/optimizer.pt", lambda p: w(p, b"not a torch file")),
        "run-metadata-truncated": ("run_metadata.json", lambda p: w(p, p.read_bytes()[: len(p.read_bytes()) // 2])),
        "run-metadata-empty": ("run_metadata.json", lambda p: w(p, "")),
        "run-metadata-not-utf8": ("run_metadata.json", lambda p: w(p, b"\xff\xfe" + p.read_bytes())),
        "train-log-garbage": ("train_log.jsonl", lambda p: w(p, b"\x00\xff garbage\n")),
    }
    for name, (rel, fn) in resume.items():
        target = "{ck2}" if "step_000002" in rel else ("{ck1}" if rel.startswith("checkpoints/step_000001")
                                                         else "{run}")
        add("resume", Case(f"resume-{name}", "", ["train", "--resume-from", target], needs_run=True,
                           setup=corrupt(rel, fn), timeout=240))
    add("resume",
        Case("resume-flipped-lr-digit", "", ["train", "--resume-from", "{ck1}"], needs_run=True, timeout=240,
             setup=corrupt(ck + "checkpoint.json", lambda p: w(p, p.read_text().replace(
                 '"learning_rate": 0.001,', '"learning_rate": 0.009,'))),
             post=lr_trusted_check, note="must refuse (checksum) or not use 0.009"),
        Case("resume-with-contradicting-override", "", ["train", "--resume-from", "{ck1}", "--model", "other"],
             needs_run=True),
        Case("resume-checkpoint-dir-is-file", "", ["train", "--resume-from", "{ck1}"], needs_run=True,
             setup=lambda c: (shutil.rmtree(c.run / "checkpoints/step_000001"),
                              w(c.run / "checkpoints/step_000001", "x"))),
        )

    # --- task options of the wrong type ---------------------------------------------------------------------
    add("task-options",
        Case("extra-test-size-abc", "", TQA + ["extra.test_size=abc"]),
        Case("extra-test-size-negative", "", TQA + ["extra.test_size=-3"]),
        Case("extra-test-size-zero", "", TQA + ["extra.test_size=0"]),
        Case("extra-test-size-float", "", TQA + ["extra.test_size=2.5"]),
        Case("extra-test-size-list", "", TQA + ["extra.test_size=[1,2]"]),
        Case("extra-format-bonus-abc", "", TQA + ["extra.format_bonus=abc"]),
        Case("extra-format-bonus-nan", "", TQA + ["extra.format_bonus=nan"], stop_at_run=True),
        Case("override-no-equals", "", TQA + ["steps"]),
        Case("override-empty-key", "", TQA + ["=3"]),
        Case("override-unknown-field", "", TQA + ["stepz=3"]),
        Case("override-deep-unknown", "", TQA + ["loss.nope.deeper=1"]),
        Case("override-type-dict", "", TQA + ["loss=3"]),
        Case("override-steps-abc", "", TQA + ["steps=abc"]),
        Case("override-bool-maybe", "", TQA + ["deterministic=maybe"]),
        Case("sweep-no-equals", "", TQA + ["--sweep", "seed"]),
        Case("sweep-empty-values", "", TQA + ["--sweep", "seed="]),
        Case("sweep-unknown-key", "", TQA + ["--sweep", "nope=1,2"]),
        Case("sweep-bad-type", "", TQA + ["--sweep", "steps=a,b"]),
        )

    # --- signals -------------------------------------------------------------------------------------------
    sigs = {"int": signal.SIGINT, "term": signal.SIGTERM, "hup": signal.SIGHUP}
    for sname, signum in sigs.items():
        for when in (0.1, 0.5):
            add("signals", Case(f"train-sig{sname}-{when}s", "", TQA, expect="signal", sig=(signum, when),
                                post=run_status_check))
        add("signals", Case(f"train-sig{sname}-at-exec-blocked", "", TQA, expect="signal", sig=(signum, 0.0),
                            blocked=True, post=run_status_check))
        add("signals", Case(f"train-sig{sname}-mid-run", "", T_LONG,
                            expect="signal",
                            sig=(signum, r"^\[data\]", 2.0), post=run_status_check, timeout=240))
        add("signals", Case(f"train-sig{sname}-at-run-start", "", TQA, expect="signal",
                            sig=(signum, r"^\[run\]", 0.0), post=run_status_check))
    add("signals",
        Case("eval-sigint-mid", "", EVAL_MID,
             expect="signal", sig=(signal.SIGINT, r"^\[eval\]|Loading weights", 0.3)),
        Case("eval-sigint-0.5s", "", EVAL, expect="signal", sig=(signal.SIGINT, 0.5)),
        Case("eval-sigterm-mid", "", EVAL_MID,
             expect="signal", sig=(signal.SIGTERM, r"^\[eval\]|Loading weights", 0.3)),
        Case("eval-sighup-mid", "", EVAL_MID,
             expect="signal", sig=(signal.SIGHUP, r"^\[eval\]|Loading weights", 0.3)),
        Case("eval-checkpoints-sigint", "", EVAL_CK + ["{run}"], expect="signal", needs_run=True,
             sig=(signal.SIGINT, r"Loading weights|^\[data\]", 0.5), timeout=240),
        Case("check-logprobs-sigint", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "16",
                                           "--num-samples", "2"], expect="signal",
             sig=(signal.SIGINT, r"Loading weights", 0.2)),
        Case("package-sigint-0.3s", "", ["package", "{run}", "--out", "{work}/p.tar.gz"], expect="signal",
             needs_run=True, sig=(signal.SIGINT, 0.3)),
        Case("summarize-sigterm-0.3s", "", ["summarize", "{run}"], expect="signal", needs_run=True,
             sig=(signal.SIGTERM, 0.3)),
        Case("resume-sigint-mid", "", ["train", "--resume-from", "{ck1}"], expect="signal", needs_run=True,
             sig=(signal.SIGINT, r"^\[data\]", 0.0), post=run_status_check, timeout=240),
        Case("cookbook-sigint-0.5s", "", ["cookbook", "tinker_cookbook.recipes.rl_loop", "model_name=tiny"],
             expect="signal", sig=(signal.SIGINT, 0.5)),
        )

    # --- cookbook ------------------------------------------------------------------------------------------
    add("cookbook",
        Case("cookbook-no-args", "", ["cookbook"]),
        Case("cookbook-unknown-module", "", ["cookbook", "no_such_module.train"]),
        Case("cookbook-unknown-recipe", "", ["cookbook", "tinker_cookbook.recipes.no_such_recipe"]),
        Case("cookbook-module-not-recipe", "", ["cookbook", "json"], timeout=90),
        Case("cookbook-empty-module", "", ["cookbook", ""]),
        Case("cookbook-dotted-garbage", "", ["cookbook", "...."]),
        Case("cookbook-path-not-module", "", ["cookbook", "/etc/passwd"]),
        Case("cookbook-unknown-renderer", "", ["cookbook", "--renderer", "nope", "tinker_cookbook.recipes.rl_loop",
                                               "model_name=tiny", "max_steps=1"], timeout=120),
        Case("cookbook-hf-dataset-missing-file", "", ["cookbook", "--hf-dataset", "openai/gsm8k={work}/nope.jsonl",
                                                      "tinker_cookbook.recipes.rl_loop", "model_name=tiny"],
             timeout=120),
        Case("cookbook-hf-dataset-no-equals", "", ["cookbook", "--hf-dataset", "openai/gsm8k",
                                                   "tinker_cookbook.recipes.rl_loop", "model_name=tiny"]),
        Case("cookbook-renderer-only", "", ["cookbook", "--renderer", "qwen3_instruct"]),
        Case("cookbook-bad-recipe-arg", "", ["cookbook", "tinker_cookbook.recipes.rl_loop", "model_name=tiny",
                                             "no_such_arg=1"], timeout=120),
        Case("cookbook-doc-form-renderer-hf-dataset", "",
             ["cookbook", "--renderer", "qwen3_instruct", "--hf-dataset", "openai/gsm8k={work}/gsm8k.jsonl",
              "tinker_cookbook.recipes.rl_loop", "model_name=tiny", "batch_size=2", "group_size=2", "max_tokens=4",
              "loss_fn=importance_sampling", "max_steps=1", "log_path={work}/runs/rl_loop"],
             expect="accept", setup=lambda c: w(c.work / "gsm8k.jsonl", qa_rows()), timeout=300,
             bad_msg=r"unrecognized arguments", note="the README's own form"),
        Case("cookbook-doc-form-renderer-only", "",
             ["cookbook", "--renderer", "qwen3_instruct", "tinker_cookbook.recipes.math_rl.train", "model_name=tiny",
              "env=arithmetic", "group_size=2", "groups_per_batch=2", "max_tokens=4", "max_steps=1", "eval_every=0",
              "loss_fn=importance_sampling",  # the recipe's default (stable_reinforce) is refused by name locally
              "save_every=0", "log_path={work}/runs/math_rl"], expect="accept", timeout=300,
             bad_msg=r"unrecognized arguments"),
        )

    # --- API backend ----------------------------------------------------------------------------------------
    blackhole = {"TINKER_BACKEND": "api", "TINKER_API_KEY": "tml-" + "a" * 40,
                 "TINKER_BASE_URL": "http://10.255.255.1:81", "HTTPS_PROXY": "", "HTTP_PROXY": ""}
    refused = dict(blackhole, TINKER_BASE_URL="http://127.0.0.1:9")
    add("api-backend",
        Case("api-no-key", "", TQA, env={"TINKER_BACKEND": "api"}, unset=("TINKER_API_KEY",)),
        Case("api-empty-key", "", TQA, env={"TINKER_BACKEND": "api", "TINKER_API_KEY": ""}),
        Case("api-key-blackhole", "", TQA, env=blackhole, timeout=150),
        Case("api-key-conn-refused", "", TQA, env=refused, timeout=150),
        Case("api-key-bad-url", "", TQA, env=dict(blackhole, TINKER_BASE_URL="not a url"), timeout=150),
        Case("api-eval-no-key", "", EVAL, env={"TINKER_BACKEND": "api"}, unset=("TINKER_API_KEY",)),
        Case("api-eval-blackhole", "", EVAL, env=blackhole, timeout=150),
        Case("api-check-logprobs-no-key", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4"],
             env={"TINKER_BACKEND": "api"}, unset=("TINKER_API_KEY",)),
        Case("backend-unknown", "", TQA, env={"TINKER_BACKEND": "nope"}),
        Case("api-credential-cmd-fails", "", TQA, env={"TINKER_BACKEND": "api", "TINKER_CREDENTIAL_CMD": "false"},
             unset=("TINKER_API_KEY",)),
        Case("api-credential-cmd-hangs", "", TQA, env={"TINKER_BACKEND": "api",
                                                        "TINKER_CREDENTIAL_CMD": "sleep 1000"},
             unset=("TINKER_API_KEY",), timeout=150),
        )

    # --- asynchronous training ------------------------------------------------------------------------------
    T3 = TQA[:-4] + ["-s", "3", "--max-tokens", "8"]
    add("async",
        Case("off-policy-negative", "", T3 + ["--off-policy", "-1"]),
        Case("off-policy-not-a-number", "", T3 + ["--off-policy", "one"]),
        Case("off-policy-1e20", "", T3 + ["--off-policy", str(10 ** 20)]),
        Case("off-policy-65", "", T3 + ["--off-policy", "65"]),
        Case("off-policy-at-steps", "", T3 + ["--off-policy", "3"]),
        Case("off-policy-yaml-float", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", "steps: 3\nnum_rollouts: 4\noff_policy: 1.5\n")),
        Case("off-policy-api-backend", "", T3 + ["--off-policy", "1"],
             env={"TINKER_BACKEND": "api", "TINKER_API_KEY": "tml-" + "x" * 40,
                  "TINKER_BASE_URL": "http://127.0.0.1:9"}, timeout=150),
        Case("off-policy-generate-sampler", "", T3 + ["--off-policy", "1", "backend.sampler=generate"],
             stop_at_run=True),
        Case("off-policy-correction-none", "", T3 + ["--off-policy", "1", "mismatch.correction=none"],
             stop_at_run=True),
        Case("off-policy-cap-without-truncate", "", T3 + ["--off-policy", "1", "mismatch.correction=mask",
                                                          "mismatch.cap=3"]),
        Case("concurrent-sampling-2", "", T3 + ["--off-policy", "1"], env={"TINKER_LOCAL_CONCURRENT_SAMPLING": "2"}),
        Case("timeline-into-a-file-as-folder", "", T3 + ["--off-policy", "1"],
             env={"TINKER_LOCAL_TIMELINE": "{work}/f/timeline.jsonl"}, setup=lambda c: w(c.work / "f", "x")),
        Case("timeline-dev-full", "", T3 + ["--off-policy", "1"], env={"TINKER_LOCAL_TIMELINE": "/dev/full"}),
        Case("resume-sync-checkpoint-with-off-policy", "", ["train", "--resume-from", "{ck1}", "--off-policy", "1"],
             needs_run=True, timeout=240),
        Case("cookbook-max-steps-off-policy-negative", "",
             ["cookbook", "--renderer", "qwen3_instruct", "tinker_cookbook.recipes.math_rl.train", "model_name=tiny",
              "env=arithmetic",
              "max_steps_off_policy=-1", "loss_fn=importance_sampling", "max_steps=1"], timeout=240),
        Case("ctl-off-policy-1", "", T3 + ["--off-policy", "1"], expect="accept", timeout=300),
        )

    # --- overwrites ----------------------------------------------------------------------------------------
    add("overwrite",
        Case("eval-out-run-metadata", "", EVAL + ["--out", "{run}/run_metadata.json"], needs_run=True),
        Case("eval-out-checkpoint-json", "", EVAL + ["--out", "{ck1}/checkpoint.json"], needs_run=True),
        Case("eval-out-train-log", "", EVAL + ["--out", "{run}/train_log.jsonl"], needs_run=True),
        Case("eval-out-adapter", "", EVAL + ["--out", "{ck2}/adapter.safetensors"], needs_run=True),
        Case("summarize-out-run-metadata", "", ["summarize", "{run}", "--out", "{run}/run_metadata.json"],
             needs_run=True),
        Case("summarize-out-train-log-csv", "", ["summarize", "{run}", "--out", "{run}/report.md"],
             needs_run=True, setup=lambda c: w(c.run / "report.md", "# kept\n")),
        Case("summarize-out-training-step", "", ["summarize", "{run}", "--out", "{run}/training_step_0.json"],
             needs_run=True),
        Case("package-out-run-metadata", "", ["package", "{run}", "--out", "{run}/run_metadata.json"],
             needs_run=True),
        Case("package-out-checkpoint", "", ["package", "{run}", "--out", "{ck1}/checkpoint.json", "--overwrite"],
             needs_run=True),
        Case("package-out-inside-run", "", ["package", "{run}", "--out", "{run}/run.tar.gz"], needs_run=True),
        Case("package-overwrite-run-file", "", ["package", "{run}", "--out", "{run}/train_log.jsonl",
                                                "--overwrite"], needs_run=True),
        Case("eval-checkpoints-out-run-metadata", "", EVAL_CK + ["{run}", "--out", "{run}/run_metadata.csv"],
             needs_run=True, setup=lambda c: w(c.run / "run_metadata.csv", "kept\n"), timeout=240),
        Case("eval-checkpoints-out-train-log", "", EVAL_CK + ["{run}", "--out", "{ck1}/checkpoint.md"],
             needs_run=True, setup=lambda c: w(c.run / "checkpoints/step_000001/checkpoint.md", "kept\n"),
             timeout=240),
        Case("eval-out-symlink-to-run", "", EVAL + ["--out", "{work}/link.json"], needs_run=True,
             setup=lambda c: os.symlink(c.run / "run_metadata.json", c.work / "link.json")),
        Case("train-log-root-is-run", "", TQA + ["--log-root", "{run}"], needs_run=True, stop_at_run=True),
        Case("resume-keeps-source", "", ["train", "--resume-from", "{ck1}"], needs_run=True, timeout=240),
        )
    # the prepared run must also stay untouched in the two protected-by-default command sets
    for c in out:
        if c.cls == "overwrite" and c.id in ("summarize-out-train-log-csv", "eval-checkpoints-out-run-metadata",
                                             "eval-checkpoints-out-train-log"):
            c.protect = ("{run}",)

    # --- silent accepts ------------------------------------------------------------------------------------
    def sa(cid: str, argv: list, words: tuple, **kw) -> Case:
        kw.setdefault("stop_at_run", True)
        return Case(cid, "", argv, expect="refuse_or_warn", warn_words=words, **kw)

    add("silent-accept",
        sa("judge-model-single-turn", TQA + ["--judge-model", "tiny"], ("judge",)),
        sa("mock-judge-single-turn", TQA + ["--mock-judge"], ("judge",)),
        sa("mock-judge-with-judge-model", ["train", "--model", "tiny", "--mode", "debate", "--env", "qa", "-n", "4",
                                           "-s", "1", "--max-tokens", "4", "--mock-judge", "--judge-model", "tiny"],
           ("judge",)),
        sa("summary-max-words-in-qa", TQA + ["--summary-max-words", "10"], ("summary",)),
        sa("clip-with-importance-sampling", TQA + ["loss.clip_low_threshold=0.8", "loss.clip_high_threshold=1.2"],
           ("clip",)),
        sa("clip-with-dro", TQA + ["--loss-fn", "dro", "loss.clip_high_threshold=1.2"], ("clip",)),
        sa("kl-estimator-kl-off", TQA + ["--kl-estimator", "k3"], ("kl",)),
        sa("val-samples-val-off", TQA + ["--val-samples", "8"], ("valid", "val-")),
        sa("val-num-problems-val-off", TQA + ["validation.num_problems=3"], ("valid",)),
        sa("truncate-without-max-prompt", TQA + ["--truncate-prompts"], ("truncat", "max-prompt", "max_prompt")),
        sa("reject-blocklisted-no-list", TQA + ["--reject-blocklisted"], ("blocklist",)),
        sa("debate-grpo-reward-rejection", ["train", "--model", "tiny", "--mode", "debate", "-n", "4",
                                                           "-s", "1", "--max-tokens", "4", "--mock-judge",
                                                           "--debate-grpo-reward", "task"], ("grpo", "reward")),
        sa("misspelt-extra-test-size", TQA + ["extra.test_sise=4"], ("test_sise", "unknown", "extra")),
        sa("misspelt-extra-format-bonus", TQA + ["extra.formatbonus=0.5"], ("formatbonus", "unknown", "extra")),
        sa("unknown-extra-summary", ["train", "--config-file", "tiny-cpu-smoke", "steps=1", "extra.foo=1"],
           ("foo", "unknown", "extra")),
        sa("summary-max-words-0", T + ["--summary-max-words", "0"], ("summary",)),
        sa("summary-max-words-negative", T + ["--summary-max-words", "-5"], ("summary",)),
        sa("lr-1e12", TQA + ["--learning-rate", "1e12"], ("learning",)),
        sa("lr-zero", TQA + ["--learning-rate", "0"], ("learning",)),
        sa("seed-negative", TQA + ["--seed=-1"], ("seed",)),
        sa("lora-rank-negative", TQA + ["--lora-rank=-4"], ("rank",)),
        sa("max-tokens-negative", TQA[:-2] + ["--max-tokens=-4"], ("token",)),
        sa("checkpoint-every-negative", TQA + ["--checkpoint-every=-1"], ("checkpoint",)),
        sa("val-every-negative", TQA + ["--val-every=-1"], ("valid", "val")),
        sa("val-samples-negative", TQA + ["--val-every", "1", "--val-samples=-2"], ("valid", "sample")),
        sa("grad-clip-negative", TQA + ["--grad-clip-norm=-1"], ("clip",)),
        sa("kl-coef-negative", TQA + ["--kl-coef=-0.5"], ("kl",)),
        sa("entropy-coef-1e6", TQA + ["--entropy-coef", "1e6"], ("entropy",)),
        sa("temperature-1e6", TQA + ["--temperature", "1e6"], ("temperature",)),
        sa("steps-true-override", TQA[:-4] + ["--max-tokens", "8", "steps=true"], ("steps",)),
        sa("sweep-repeat-key", TQA + ["--sweep", "seed=1,2", "--sweep", "seed=3"], ("sweep", "seed"),
           stop_at_run=False, timeout=240),
        sa("sweep-repeat-point", TQA + ["--sweep", "seed=1,1"], ("sweep", "repeat", "duplicate"),
           stop_at_run=False, timeout=240),
        sa("sweep-show-config-repeat-point", ["show-config", "--model", "tiny", "--sweep", "seed=2,2"],
           ("sweep", "repeat", "duplicate"), stop_at_run=False),
        sa("name-newline", TQA + ["--name", "a\nb"], ("name",)),
        sa("name-carriage-return", TQA + ["--name", "a\rb"], ("name",)),
        sa("name-slash", TQA + ["--name", "../../escape"], ("name",)),
        sa("name-tab-escape", TQA + ["--name", "x\x1b[2Jy"], ("name",)),
        sa("name-empty", TQA + ["--name", ""], ("name",)),
        sa("name-300-chars", TQA + ["--name", "n" * 300], ("name",)),
        sa("package-non-run-dir", ["package", "{work}/notarun", "--out", "{work}/x.tar.gz"], ("run",),
           setup=lambda c: w(c.work / "notarun/hello.txt", "hi\n"), stop_at_run=False),
        sa("package-empty-dir", ["package", "{work}/empty", "--out", "{work}/x.tar.gz"], ("run",),
           setup=lambda c: (c.work / "empty").mkdir(), stop_at_run=False),
        sa("data-references-all-empty", ["train", "--model", "tiny", "--env", "math", "--dataset",
                                         "{work}/data.jsonl", "-n", "4", "-s", "1", "--max-tokens", "8"],
           ("empty", "reference", "answer"), stop_at_run=False, timeout=240,
           setup=lambda c: w(c.work / "data.jsonl", "".join(json.dumps({"question": f"q{i}?", "answer": ""}) + "\n"
                                                           for i in range(8)))),
        sa("data-summary-highlights-empty", ["train", "--config-file", "tiny-cpu-smoke", "steps=1", "--dataset",
                                             "{work}/data.jsonl"], ("empty", "highlight", "reference"),
           stop_at_run=False, timeout=240,
           setup=lambda c: w(c.work / "data.jsonl", "".join(json.dumps(
               {"id": str(i), "article": "The council met today. " * 20, "highlights": ""}) + "\n" for i in range(8)))),
        sa("no-proxy-no-effect", TQA + ["--no-proxy"], ("proxy",), note="documented as accepted and ignored"),
        sa("eval-ks-above-samples", EVAL[:-2] + ["--ks", "16", "--resamples", "50"], ("k",), stop_at_run=False),
        sa("eval-threshold-above-max-reward", EVAL + ["--threshold", "5"], ("threshold",), stop_at_run=False),
        sa("num-groups-rs-grpo-no-reward", ["train", "--model", "tiny", "--mode", "debate", "-n", "4", "-s", "1",
                                            "--max-tokens", "4", "--mock-judge", "--blocklist", "x",
                                            "--judge-model", "tiny"], ("judge",)),
        )
    # the documented no-op option is a control: accepted with or without a warning
    for c in out:
        if c.id == "no-proxy-no-effect":
            c.expect, c.cls = "accept", "controls"

    # --- secrets -------------------------------------------------------------------------------------------
    sk = "sk-proj-" + "Ab3" * 12
    def sec(cid: str, argv: list, secret: str, **kw) -> Case:
        kw.setdefault("timeout", 240)
        return Case(cid, "", argv, secret=secret, **kw)

    add("secrets",
        sec("extra-openai-key", T + ["checkpoint.every=1", f"extra.openai_key={sk}"], sk),
        sec("extra-passphrase", TQA + ["--checkpoint-every", "1", "extra.passphrase=correct-horse-battery-9"],
            "correct-horse-battery-9"),
        sec("extra-note-with-sk", TQA + [f"extra.note=key is {sk}"], sk, stop_at_run=True),
        sec("name-with-secret", TQA + ["--name", f"run-{sk}"], sk, stop_at_run=True),
        sec("sweep-secret-in-name", TQA + ["--sweep", f"extra.api_key={sk},{sk}x"], sk, stop_at_run=True),
        sec("sweep-secret-other-key", TQA + ["--sweep", "extra.openai_key=sk-" + "Zz9" * 12 + ",x"],
            "sk-" + "Zz9" * 12, stop_at_run=True),
        sec("env-url-userinfo", TQA, "hunter2pass", env={"HTTPS_PROXY": "http://bob:hunter2pass@proxy.invalid:3128"},
            stop_at_run=True),
        sec("env-hf-endpoint-userinfo", TQA, "s3cr3tpw", env={"HF_ENDPOINT": "https://u:s3cr3tpw@hf.invalid"},
            stop_at_run=True),
        sec("env-vllm-url-userinfo", TQA, "vllmpw77", env={"TINKER_LOCAL_VLLM_URL": "http://a:vllmpw77@127.0.0.1:9"},
            stop_at_run=True),
        sec("dataset-url-userinfo", TQA[:6] + ["https://u:dspw9911@example.invalid/d.jsonl"] + TQA[7:], "dspw9911"),
        sec("yaml-github-token", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
            "ghp_" + "A1b2" * 9, setup=lambda c: w(c.work / "cfg.yaml", "steps: 1\nnum_rollouts: 4\nmax_tokens: 8\n"
                                                  "extra:\n  gh: ghp_" + "A1b2" * 9 + "\n"), stop_at_run=True),
        sec("blocklist-secret", TQA + ["--blocklist", sk], sk, stop_at_run=True),
        )
    pk = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n-----END OPENSSH PRIVATE KEY-----\n"
    pkg_files = {
        "git-credentials": (".git-credentials", "https://alice:ghp_" + "Q7w" * 12 + "@github.com\n"),
        "npmrc": (".npmrc", "//registry.npmjs.org/:_authToken=npm_" + "x9Y" * 12 + "\n"),
        "pypirc": (".pypirc", "[pypi]\nusername = __token__\npassword = pypi-AgEIcHlwaS5vcmc" + "Kq1" * 10 + "\n"),
        "putty-key": ("id_ed25519.ppk", "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nComment: k\n"
                      "Public-Lines: 1\nAAAAC3NzaC1lZDI1NTE5AAAAIG\nPrivate-Lines: 1\nAAAAIDx9\n"),
        "token-named-file": ("hf_token", "hf_" + "Kx7" * 12 + "\n"),
        "api-token-txt": ("api_token.txt", "tok_" + "9f8e" * 8 + "\n"),
        "slack-webhook": ("notes.txt", "hook: https://hooks.slack.com/services/T01ABCDEF/B02GHIJKL/"
                          + "Xy7" * 8 + "\n"),
        "aws-secret-key": ("aws.cfg", "[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "EXAMPLEKEY\n"),
        "aws-credentials-file": (".aws/credentials", "[default]\naws_access_key_id = AKIA" + "ABCDEFGHIJKLMNOP"
                                 + "\naws_secret_access_key = " + "s" * 40 + "\n"),
        "netrc": (".netrc", "machine example.com login bob password hunter2\n"),
        "docker-config": (".docker/config.json", '{"auths": {"r.io": {"auth": "Ym9iOmh1bnRlcjI="}}}\n'),
        "private-key-plain": ("id_rsa", pk),
        "private-key-gzip": ("blob.gz", gzip.compress(pk.encode())),
        "private-key-base64": ("blob.b64", base64.b64encode(pk.encode()).decode() + "\n"),
        "private-key-utf16": ("blob16.txt", pk.encode("utf-16")),
        "sk-key-utf16": ("notes16.txt", ("key " + sk + "\n").encode("utf-16-le")),
        "sk-key-gzip": ("log.jsonl.gz", gzip.compress(('{"k": "' + sk + '"}\n').encode())),
        "sk-key-base64": ("cfg.b64", base64.b64encode(("OPENAI_API_KEY=" + sk).encode()).decode() + "\n"),
        "gcp-service-account": ("sa.json", '{"type": "service_account", "private_key_id": "abc", '
                                '"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIE\\n-----END PRIVATE KEY-----\\n"}'),
        "env-file": (".env", "OPENAI_API_KEY=" + sk + "\n"),
        "kube-config": (".kube/config", "users:\n- name: u\n  user:\n    token: eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl\n"),
    }
    for name, (rel, body) in pkg_files.items():
        add("secrets", Case(f"package-{name}", "", ["package", "{run}", "--out", "{work}/run.tar.gz"],
                            needs_run=True, setup=lambda c, rel=rel, body=body: w(c.run / rel, body),
                            post=archive_has(re.escape(Path(rel).name) + "$")))

    # --- misleading messages -------------------------------------------------------------------------------
    add("misleading",
        data_case("data-u2028-in-string", qa_rows(3) + '{"question": "a\u2028b 2+2?", "answer": "#### 4"}\n',
                  expect="accept", bad_msg=r"not valid JSON", stop_at_run=True),
        data_case("data-u0085-in-string", qa_rows(3) + '{"question": "a\u0085b 2+2?", "answer": "#### 4"}\n',
                  expect="accept", bad_msg=r"not valid JSON", stop_at_run=True),
        data_case("data-u2029-in-string", qa_rows(3) + '{"question": "a\u2029b 2+2?", "answer": "#### 4"}\n',
                  expect="accept", bad_msg=r"not valid JSON", stop_at_run=True),
        data_case("data-crlf-lines", qa_rows(4).replace("\n", "\r\n").replace("\\n", "\\n"), expect="accept",
                  bad_msg=r"not valid JSON", stop_at_run=True),
        Case("lr-minus-1", "", TQA + ["--learning-rate", "-1"], bad_msg=r"expected one argument"),
        Case("seed-minus-1-space", "", TQA + ["--seed", "-1"], bad_msg=r"expected one argument"),
        Case("kl-coef-minus-space", "", TQA + ["--kl-coef", "-0.1"], bad_msg=r"expected one argument"),
        Case("dtype-bf16-alias", "", TQA, env={"TINKER_LOCAL_DTYPE": "bf16"}, bad_msg=r"no update happened"),
        Case("dtype-garbage", "", TQA, env={"TINKER_LOCAL_DTYPE": "float7"}, bad_msg=r"no update happened"),
        Case("device-cuda-on-cpu", "", TQA, env={"TINKER_LOCAL_DEVICE": "cuda"}, bad_msg=r"data ?set|connection"),
        Case("gpu-preset-on-cpu", "", ["train", "--config-file", "h100-rlvr", "steps=1"],
             bad_msg=r"data ?set.*(connect|network)|ConnectionError|could not reach|hub", timeout=120),
        Case("gpu-preset-8b-on-cpu", "", ["train", "--config-file", "gpu-8b-lora-4bit", "steps=1"],
             bad_msg=r"data ?set.*(connect|network)|ConnectionError", timeout=120),
        Case("model-hub-id-offline", "", ["train", "--model", "Qwen/Qwen3-0.6B"] + TQA[3:],
             bad_msg=r"data ?set.*connect", timeout=120),
        Case("sampler-unknown", "", TQA, env={"TINKER_LOCAL_SAMPLER": "nope"}),
        Case("numerics-unknown", "", TQA, env={"TINKER_LOCAL_NUMERICS": "fast"}),
        Case("micro-batch-tokens-abc", "", TQA, env={"TINKER_LOCAL_MICRO_BATCH_TOKENS": "abc"}),
        Case("micro-batch-tokens-zero", "", TQA, env={"TINKER_LOCAL_MICRO_BATCH_TOKENS": "0"}),
        Case("grad-accum-negative", "", TQA, env={"TINKER_LOCAL_GRAD_ACCUM_STEPS": "-2"}),
        Case("env-seed-abc", "", TQA, env={"TINKER_LOCAL_SEED": "abc"}),
        Case("lora-alpha-abc", "", TQA, env={"TINKER_LOCAL_LORA_ALPHA": "abc"}),
        Case("unknown-mode", "", TQA + ["--mode", "multi_turn"]),
        Case("unknown-env", "", TQA + ["--env", "code"]),
        Case("unknown-loss", "", TQA + ["--loss-fn", "grpo"]),
        Case("unknown-reward-fn", "", TQA + ["--reward-fn", "rouge"]),
        Case("unknown-preset", "", ["train", "--config-file", "tiny-cpu-smok"]),
        Case("num-groups-not-dividing", "", TQA + ["--num-groups", "3"]),
        Case("expected-hash-wrong", "", TQA + ["--expected-dataset-hash", "00"]),
        Case("show-config-device-memory-garbage", "", ["show-config", "--device-memory", "lots"]),
        Case("show-config-device-memory-huge", "", ["show-config", "--model", "tiny", "--device-memory",
                                                    "1" + "0" * 40 + "GiB"]),
        Case("bench-history-missing-storage", "", ["bench-history", "--storage", "{root}/nope"]),
        Case("bench-history-storage-is-file", "", ["bench-history", "--storage", "{root}/f"],
             setup=lambda c: w(c.root / "f", "x")),
        )
    return out


# --- running -------------------------------------------------------------------------------------------------


def base_env(ctx: Ctx) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TINKER_", "RLRUNBOOK_", "HF_", "WANDB_", "TRANSFORMERS_", "PYTEST"))
           and k not in ("HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR", "TMPDIR", "VIRTUAL_ENV")}
    env.update({
        "HOME": str(ctx.home), "XDG_CACHE_HOME": str(ctx.home / ".cache"),
        "MPLCONFIGDIR": str(ctx.home / ".config" / "matplotlib"), "TMPDIR": str(ctx.root / "tmp"),
        "RLRUNBOOK_CACHE_DIR": str(ctx.cache), "TINKER_LOCAL_STORAGE": str(ctx.store),
        "RLRUNBOOK_LOG_ROOT": str(ctx.logs), "RLRUNBOOK_DATA_DIR": str(ctx.home / "data"),
        "HF_HOME": str(ctx.home / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "NO_COLOR": "1",
    })
    return env


def fmt_arg(ctx: Ctx, a: str | bytes) -> bytes:
    if isinstance(a, bytes):
        return a.replace(b"{root}", os.fsencode(str(ctx.root)))
    return os.fsencode(ctx.fmt(a)) if "{" in a else a.encode("utf-8", "surrogateescape")


def snapshot(paths: list[Path]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in paths:
        items = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else []
        for f in items:
            try:
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
            except OSError:
                out[str(f)] = "unreadable"
    return out


def find_secret(ctx: Ctx, secret: str) -> list[str]:
    hits = []
    needle = secret.encode()
    roots = [ctx.logs, ctx.store, ctx.work / "runs"]
    for root in roots:
        if not root.exists():
            continue
        for p in root.rglob("*"):
            if ctx.run is not None and (p == ctx.run or ctx.run in p.parents):
                continue
            if secret in p.name:
                hits.append(f"path name {p.relative_to(ctx.root)}")
            elif p.is_file():
                try:
                    if needle in p.read_bytes():
                        hits.append(f"{p.relative_to(ctx.root)}")
                except OSError:
                    pass
    return hits


def preexec(mem_bytes: int, blocked: bool = False) -> Callable[[], None]:
    def fn() -> None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
            signal.signal(s, signal.SIG_DFL)
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            os.nice(0)
            if mem_bytes:
                resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        except (OSError, ValueError):
            pass
    return fn


@dataclass
class Result:
    id: str
    cls: str
    outcome: str
    message: str
    rc: int | None
    seconds: float
    expect: str
    argv: list
    note: str = ""
    output_tail: str = ""


def handles_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a handler for SIGTERM (``SigCgt`` of /proc/PID/status): rlrunbook's first act."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone, or not Linux: not "before the handlers"
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_case(case: Case, exe: list[str], tmp_root: Path, template: Path | None, default_timeout: float,
             mem_bytes: int, keep: bool) -> Result:
    root = Path(tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9_.-]", "_", case.id)[:60] + "-", dir=tmp_root))
    ctx = Ctx(root=root, home=root / "home", work=root / "work", logs=root / "work" / "logs",
              store=root / "home" / "store", cache=root / "home" / "cache")
    for d in (ctx.home, ctx.work, ctx.store, ctx.cache, ctx.home / "data", root / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    argv: list = []
    try:
        if template is not None:
            # the built tiny model and matplotlib's font cache: every case starts from a warm cache
            shutil.copytree(template / "home" / "cache" / "models", ctx.cache / "models", dirs_exist_ok=True)
            for sub in (".cache", ".config"):
                if (template / "home" / sub).exists():
                    shutil.copytree(template / "home" / sub, ctx.home / sub, dirs_exist_ok=True)
            if case.needs_run:
                shutil.copytree(template / "work" / "logs", ctx.logs, dirs_exist_ok=True, symlinks=True)
                shutil.copytree(template / "home" / "store", ctx.store, dirs_exist_ok=True)
                ctx.run = next(p for p in ctx.logs.iterdir() if p.is_dir())
        elif case.needs_run:
            return Result(case.id, case.cls, "bad_state", "no prepared run (template failed)", None, 0.0,
                          case.expect, [], case.note)
        if case.setup is not None:
            case.setup(ctx)
        env = base_env(ctx)
        for k in case.unset:
            env.pop(k, None)
        envb: dict[bytes, bytes] = {k.encode(): v.encode("utf-8", "surrogateescape") for k, v in env.items()}
        for k, v in case.env.items():
            envb[k.encode()] = (v.replace(b"{root}", os.fsencode(str(root))) if isinstance(v, bytes)
                                else os.fsencode(ctx.fmt(v)))
        argv = [a.encode() if isinstance(a, str) else a for a in exe] + [fmt_arg(ctx, a) for a in case.argv]
        protect = [Path(ctx.fmt(p)) for p in case.protect]
        if case.needs_run and ctx.run is not None:
            protect.append(ctx.run)
        before = snapshot(protect)
        timeout = case.timeout or default_timeout
        out_path = root / "output.txt"
        timed_out = stopped = False
        sig_sent = before_handlers = False
        run_seen_at: float | None = None
        pattern_seen_at: float | None = None
        with open(out_path, "wb") as out_f:
            proc = subprocess.Popen(argv, cwd=ctx.work, env=envb, stdout=out_f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=preexec(mem_bytes, case.blocked))
            start = time.monotonic()
            while True:
                try:
                    proc.wait(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic() - start
                if now > timeout:
                    kill_group(proc)
                    proc.wait()
                    timed_out = True
                    break
                need_text = (case.sig is not None and len(case.sig) == 3 and not sig_sent) or case.stop_at_run
                text = out_path.read_bytes().decode("utf-8", "replace") if need_text else ""
                if case.sig is not None and not sig_sent:
                    if len(case.sig) == 2:
                        fire = now >= case.sig[1]
                    else:
                        if pattern_seen_at is None and re.search(case.sig[1], text, re.M):
                            pattern_seen_at = now
                        fire = pattern_seen_at is not None and now >= pattern_seen_at + case.sig[2]
                    if fire:
                        before_handlers = not case.blocked and not handles_sigterm(proc.pid)
                        try:
                            os.kill(proc.pid, case.sig[0])
                        except ProcessLookupError:
                            pass
                        sig_sent = True
                if case.stop_at_run:
                    if run_seen_at is None and RUN_LINE.search(text):
                        run_seen_at = now
                    if run_seen_at is not None and (re.search(r"^\[data\] (?!warning|notice)|Loading weights|^train:",
                                                              text, re.M) or now > run_seen_at + 15):
                        time.sleep(0.3)
                        kill_group(proc)
                        proc.wait()
                        stopped = True
                        break
            # children of the command (a vLLM server, workers) go with it
            kill_group(proc)
        output = out_path.read_bytes().decode("utf-8", "replace")
        make_mutable(root)
        changed = []
        after = snapshot(protect)
        for f, h in before.items():
            if f not in after:
                changed.append(f"{Path(f).relative_to(root)} (removed)")
            elif after[f] != h:
                changed.append(str(Path(f).relative_to(root)))
        secrets = tuple(find_secret(ctx, case.secret)) if case.secret else ()
        extra = case.post(ctx, output) if case.post is not None and not timed_out else None
        signum = case.sig[0] if case.sig is not None else None
        outcome, msg = classify(expect=case.expect, rc=proc.returncode, output=output, timed_out=timed_out,
                                signum=signum if sig_sent else None, stopped_at_run=stopped,
                                warn_words=case.warn_words, bad_msg=case.bad_msg, changed=tuple(changed),
                                secrets=secrets, extra=extra, before_handlers=before_handlers)
        if case.sig is not None and not sig_sent and outcome in PASSING:  # the case tested nothing
            outcome, msg = "missed_signal", f"ended ({describe_exit(proc.returncode)}) before its signal: {msg}"
        return Result(case.id, case.cls, outcome, msg[:300], proc.returncode, round(time.monotonic() - t0, 1),
                      case.expect, [os.fsdecode(a) for a in argv[len(exe):]], case.note,
                      "\n".join(output_lines(output)[-15:])[-3000:])
    except Exception as exc:  # a harness error is reported as such, never as a pass
        return Result(case.id, case.cls, "bad_state", f"harness error: {type(exc).__name__}: {exc}", None,
                      round(time.monotonic() - t0, 1), case.expect, [os.fsdecode(a) for a in argv], case.note)
    finally:
        make_mutable(root)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def build_template(exe: list[str], tmp_root: Path, mem_bytes: int) -> Path | None:
    """One finished run with two checkpoints (tiny-cpu-smoke, 2 steps), the tiny model built and cached."""
    tmpl = tmp_root / "template"
    ctx = Ctx(root=tmpl, home=tmpl / "home", work=tmpl / "work", logs=tmpl / "work" / "logs",
              store=tmpl / "home" / "store", cache=tmpl / "home" / "cache")
    for d in (ctx.home, ctx.work, ctx.store, ctx.cache, ctx.home / "data", tmpl / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    argv = exe + ["train", "--config-file", "tiny-cpu-smoke", "steps=2", "num_rollouts=4", "max_tokens=8",
                  "checkpoint.every=1", "--name", "prepared"]
    print("[hostile] preparing a run to resume, package and evaluate:", " ".join(argv[len(exe):]), flush=True)
    p = subprocess.run(argv, cwd=ctx.work, env=base_env(ctx), capture_output=True, text=True, timeout=900,
                       preexec_fn=preexec(mem_bytes))
    runs = [d for d in ctx.logs.iterdir() if d.is_dir()] if ctx.logs.exists() else []
    if p.returncode != 0 or len(runs) != 1 or not (runs[0] / "checkpoints" / "step_000002").is_dir():
        print(f"[hostile] the prepared run failed (exit {p.returncode}); cases that need it are reported as "
              f"bad_state.\n{(p.stdout + p.stderr)[-2000:]}", flush=True)
        return tmpl if (ctx.cache / "models").exists() else None
    return tmpl


def resolve_exe(arg: str | None) -> list[str]:
    target = Path(arg) if arg else REPO / ".venv"
    if target.is_dir():
        for cand in (target / "bin" / "rlrunbook", target / "rlrunbook"):
            if cand.exists():
                return [str(cand)]
        raise SystemExit(f"no rlrunbook command in {target} (looked in bin/ and the folder itself)")
    if target.exists() or shutil.which(str(target)):
        return [str(target) if target.exists() else shutil.which(str(target))]
    raise SystemExit(f"{target}: not a venv, folder or command")


def table(results: list[Result]) -> str:
    classes = sorted({r.cls for r in results})
    used = [o for o in OUTCOMES if any(r.outcome == o for r in results)]
    head = ["class", "cases"] + used
    rows = []
    for cls in classes + ["TOTAL"]:
        rs = [r for r in results if cls == "TOTAL" or r.cls == cls]
        rows.append([cls, str(len(rs))] + [str(sum(r.outcome == o for r in rs) or "") for o in used])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(wd) for c, wd in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * wd for wd in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", help="a venv (its bin/rlrunbook), a bin folder or the rlrunbook command "
                                              "(default: the repository's .venv)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="cases run in parallel (2)")
    ap.add_argument("--only", action="append", default=[], metavar="CLASS_OR_ID",
                    help="run only this class or case id, or those matching it as a regex (repeatable)")
    ap.add_argument("--exclude", action="append", default=[], metavar="CLASS_OR_ID",
                    help="leave out this class or case id, or those matching it as a regex (repeatable)")
    ap.add_argument("--json", metavar="OUT", help="write every result as JSON (rewritten after each case, so an "
                                                  "interrupted run keeps what it finished)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per case unless the case sets its own (120)")
    ap.add_argument("--mem-gib", type=float, default=12.0, help="address-space limit of each case in GiB (12; 0 = "
                                                                 "none)")
    ap.add_argument("--keep", action="store_true", help="keep every case's folder (under the --tmp folder)")
    ap.add_argument("--tmp", help="folder for the case folders (default: a new one under $TMPDIR)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)

    all_cases = cases()
    ids = [c.id for c in all_cases]
    dup = {i for i in ids if ids.count(i) > 1}
    assert not dup, f"duplicate case ids: {dup}"
    def matches(c: Case, pats: list[str]) -> bool:
        return any(o == c.cls or o == c.id or re.fullmatch(o, c.id) for o in pats)

    selected = [c for c in all_cases if (not args.only or matches(c, args.only)) and not matches(c, args.exclude)]
    if args.only or args.exclude:
        if not selected:
            raise SystemExit(f"--only {args.only}: no case; classes: {sorted({c.cls for c in all_cases})}")
    if args.list:
        for c in selected:
            print(f"{c.cls:14} {c.id:45} expect={c.expect:14} {' '.join(map(lambda a: os.fsdecode(a) if isinstance(a, bytes) else a, c.argv))!r}"[:240])
        counts = {}
        for c in selected:
            counts[c.cls] = counts.get(c.cls, 0) + 1
        print(f"{len(selected)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return 0

    exe = resolve_exe(args.target)
    tmp_root = Path(args.tmp) if args.tmp else Path(tempfile.mkdtemp(prefix="hostile-inputs-"))
    tmp_root.mkdir(parents=True, exist_ok=True)
    mem = int(args.mem_gib * (1 << 30))
    started = time.time()
    print(f"[hostile] {len(selected)} cases against {exe[0]}, {args.jobs} workers, case folders in {tmp_root}",
          flush=True)
    template = build_template(exe, tmp_root, mem)
    print(f"[hostile] prepared in {time.time() - started:.0f}s", flush=True)

    results: list[Result] = []
    lock = threading.Lock()

    def write_json() -> None:
        if not args.json:
            return
        done = sorted(results, key=lambda r: (r.cls, r.id))
        counts = {cls: {o: sum(1 for r in done if r.cls == cls and r.outcome == o) for o in OUTCOMES}
                  for cls in sorted({r.cls for r in done})}
        totals = {o: sum(1 for r in done if r.outcome == o) for o in OUTCOMES}
        Path(args.json).write_text(json.dumps({
            "target": exe[0], "cases": len(done), "selected": len(selected),
            "seconds": round(time.time() - started), "totals": totals, "counts": counts,
            "failing": [r.id for r in done if r.outcome not in PASSING],
            "results": [r.__dict__ for r in done]}, indent=1, ensure_ascii=True))

    # the slow cases first, so that the tail of the run is not one long case on one worker
    order = sorted(selected, key=lambda c: -(c.timeout or args.timeout))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_case, c, exe, tmp_root, template, args.timeout, mem, args.keep): c for c in order}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            with lock:
                results.append(r)
                mark = "ok " if r.outcome in PASSING else "BAD"
                print(f"[{len(results):3}/{len(selected)}] {mark} {r.cls:13} {r.id:42} {r.outcome:14} "
                      f"{r.seconds:6.1f}s  {r.message[:110]}", flush=True)
                write_json()
    results.sort(key=lambda r: (r.cls, r.id))
    print()
    print(table(results))
    bad = [r for r in results if r.outcome not in PASSING]
    print(f"\n{len(results)} cases in {time.time() - started:.0f}s: {len(results) - len(bad)} pass, {len(bad)} fail")
    for r in bad:
        print(f"  {r.id}: {r.outcome}: {r.message.splitlines()[0][:160] if r.message else ''}")
    if args.json:
        write_json()
        print(f"written: {args.json}")
    if not args.keep:
        make_mutable(tmp_root)
        shutil.rmtree(tmp_root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
