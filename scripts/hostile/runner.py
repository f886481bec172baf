"""Runs one case of the hostile-input run, and prepares the run that cases resume, package and evaluate.

``run_case`` gives the case a fresh folder of its own (HOME, working folder, storage, cache, log root, an empty
data folder, Hugging Face offline; ``base_env``), copies the prepared template into it, runs its setup, starts
the command in a new process group under an address-space limit, sends its signal or stops it once its run has
started, kills the whole group at the end (``kill_group``), compares the hashes of the protected files
(``snapshot``), looks for its secret (``find_secret``) and returns a ``Result`` classified by
``classify.classify``. A harness error is a ``bad_state`` result, never a pass. ``build_template`` makes the
prepared run: tiny-cpu-smoke, 2 steps, a checkpoint at each.
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .case import Case, Ctx, make_mutable
from .classify import PASSING, RUN_LINE, classify, describe_exit, output_lines


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
