"""The case model of the hostile-input run and what the case tables share.

``Case`` is one input: the ``rlrunbook`` arguments as a user types them, its environment, a setup that writes
files into the case's own folders (``Ctx``), what it expects and its post-check. ``Add`` is how a table of one
class adds its cases. The shared command lines (``T``, ``T_LONG``, ``TQA``, ``EVAL``, ``EVAL_MID``,
``EVAL_CK``) are cheap runs on the built-in ``tiny`` model; the helpers build data and YAML cases, make folders
unwritable (for root too, with ``chattr +i``) and check a finished case (``archive_has``, ``run_status_check``,
``lr_trusted_check``). Nothing here starts a process except ``chattr``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from .classify import warning_lines


@dataclass
class Ctx:
    """The folders of one case; ``fmt`` fills ``{root}``, ``{work}``, ``{run}``, ``{ck1}``, ... in a string."""

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
    """One hostile input; its class (``cls``) is set by the table that adds it."""

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


class Add(Protocol):
    """Adds cases to the table in order, setting their class: ``add("limits", case, ...)``."""

    def __call__(self, cls: str, *items: Case) -> None: ...


def w(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path``, making its folders; a str is UTF-8 with lone surrogates kept."""
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
