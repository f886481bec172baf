"""Signals and dead runs, with real processes: Ctrl-C (SIGINT to the process group, as a terminal sends it),
SIGTERM and SIGHUP (the terminal closed) stop a run cleanly (exit 130 / 143 / 129, status ``interrupted``,
last checkpoint intact, no traceback, no "terminate called", no process left); after ``kill -9`` the run is
``stale`` in ``summarize`` and ``check-run``. The installed ``rlrunbook`` command stops the same way on a
signal in the first instant of start-up, while its modules load, and ``eval`` on Ctrl-C in mid-sampling.

Each test starts ``rlrunbook train`` on ``tiny`` in its own session through a driver that first starts
the math checker's worker process, so "no orphan" is checked with a child process present. The signal is
sent once the step-1 checkpoint exists, i.e. in the middle of a later step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlrunbook import cli
from rlrunbook.cli import app as cli_app  # main reads parse_args from here
from rlrunbook.run.checkpoint_format import checkpoint_dirs, load_checkpoint

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux"),
              pytest.mark.slow]

# The driver first gives SIGINT Python's own handler, as a run started from a terminal has it: a suite started in
# the background by a shell without job control (`cmd &`, nohup, some CI runners) passes SIGINT on ignored, and
# Python keeps an inherited "ignore", so Ctrl-C would never reach the run.
DRIVER = """
import signal
import sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from rlrunbook import cli
from rlrunbook.rl.rewards.symbolic import _checker
_checker.compare(r"\\\\sqrt{4}", "2")  # a child process now exists: the math checker's worker
print("worker", _checker._process.pid, flush=True)
sys.exit(cli.main(sys.argv[1:]))
"""
TRAIN = ["train", "--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "8", "--num-groups", "2",
         "--max-tokens", "16", "-s", "10000", "--checkpoint-every", "1"]


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    root = tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(cli.__file__).parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, str(driver), *TRAIN, "--log-root", str(root)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(root.glob("*/checkpoints/step_000001")):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the run ended or stalled before its step-1 checkpoint: {process.communicate()[1][-2000:]}")
        time.sleep(0.1)
    time.sleep(0.3)  # inside step 2 (or its save): the interrupt cuts a step short
    (run,) = root.iterdir()
    return process, run


def _group_gone(pgid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_an_interrupt_stops_the_run_cleanly(tmp_path, signum, code):
    process, run = _start(tmp_path)
    os.killpg(process.pid, signum)  # the whole group, as Ctrl-C in a terminal
    _, err = process.communicate(timeout=120)
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    name = signal.Signals(signum).name
    assert f"interrupted ({name}): run {run} marked 'interrupted'; last checkpoint" in err
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert metadata["status"] == "interrupted" and metadata["error"].startswith(f"{name}: stopped by the user")
    last_step, last = checkpoint_dirs(run)[-1]
    assert load_checkpoint(last).step == last_step >= 1  # complete and verified (sha256 of every file)
    assert _group_gone(process.pid), "a process of the run (the math worker?) outlived it"


def test_a_run_killed_with_sigkill_shows_as_stale(tmp_path, capsys):
    process, run = _start(tmp_path)
    worker = int(process.stdout.readline().split()[1])
    os.kill(process.pid, signal.SIGKILL)  # the run's process only: no handler runs, nothing is written
    process.wait(timeout=30)
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert metadata["status"] == "running" and metadata["process"]["pid"] == process.pid
    assert _group_gone(process.pid), f"the math worker {worker} outlived its killed parent"

    assert cli.main(["summarize", str(run)]) == 0
    table = capsys.readouterr().out
    assert "stale" in table.splitlines()[1]
    assert cli.main(["check-run", str(run)]) == 1
    report = capsys.readouterr().out
    assert f"status is 'running' but it is stale: its process {process.pid} on" in report
    assert "no longer exists" in report


# --- the installed command, as users start it -------------------------------------------------------------------

COMMAND = Path(sys.executable).with_name("rlrunbook")  # the console script of this environment


def _with_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so Python installs its Ctrl-C handler (see DRIVER)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _caught(pid: int) -> int:
    """The mask of signals ``pid`` has a handler for (``SigCgt`` of /proc/PID/status); 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)


def test_the_console_script_enters_through_the_signal_handlers():
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="rlrunbook")
    assert script.value == "rlrunbook.cli.launch:launch"
    # What the script imports before the handlers are in place: nothing heavy, not the command line itself.
    probe = ("import sys, rlrunbook.cli.launch; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers', 'numpy', 'pydantic') or m == 'rlrunbook.cli.app'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_in_the_first_instant_of_start_up(tmp_path, signum, code):
    """Sent the moment the SIGTERM handler exists: the command is still importing (torch not yet loaded)."""
    process = subprocess.Popen([str(COMMAND), *TRAIN, "--log-root", str(tmp_path / "logs")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_with_sigint)
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + 60
    while not _caught(process.pid) & bit:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.001)
    maps = Path(f"/proc/{process.pid}/maps").read_text()
    os.killpg(process.pid, signum)
    _, err = process.communicate(timeout=120)
    assert "libtorch" not in maps, "the handler came only after torch was loaded"
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err and f"interrupted ({signal.Signals(signum).name})" in err, err[-3000:]
    runs = list((tmp_path / "logs").glob("*/run_metadata.json"))
    assert all(json.loads(path.read_text())["status"] == "interrupted" for path in runs)


def _blocked_from_exec() -> None:
    """In the child before exec: as a supervisor that must not lose a signal starts the command
    (``env --block-signal=INT,TERM,HUP``): the three signals blocked, SIGINT at its default."""
    _with_sigint()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_sent_at_exec_to_a_blocked_start_is_handled(tmp_path, signum, code):
    """Sent as soon as ``exec`` has happened, before the interpreter runs a line: it waits, blocked, and the
    command handles it once its handlers are in place. A one-step run: a signal never delivered lets it finish."""
    argv = [str(COMMAND), *TRAIN, "--log-root", str(tmp_path / "logs"), "-s", "1"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=_blocked_from_exec)
    handlers_then = _caught(process.pid)  # Popen returns once exec has succeeded
    os.killpg(process.pid, signum)
    _, err = process.communicate(timeout=300)
    assert not handlers_then & (1 << (signal.SIGTERM - 1)), "the signal came only after the handlers: not at exec"
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err and f"interrupted ({signal.Signals(signum).name})" in err, err[-3000:]
    runs = list((tmp_path / "logs").glob("*/run_metadata.json"))
    assert all(json.loads(path.read_text())["status"] == "interrupted" for path in runs)


def test_ctrl_c_during_eval_exits_130(tmp_path):
    err_file = tmp_path / "err.txt"
    with err_file.open("w") as err:
        process = subprocess.Popen([str(COMMAND), "eval", "--model", "tiny", "--env", "qa", "--dataset", "test",
                                    "--samples", "8", "--max-tokens", "64"], stdout=subprocess.PIPE, stderr=err,
                                   text=True, start_new_session=True, preexec_fn=_with_sigint)
        deadline = time.monotonic() + 300
        for line in process.stdout:  # "[eval] 256 problems x 8 samples ...": sampling has started
            if line.startswith("[eval]") or time.monotonic() > deadline:
                break
        time.sleep(1.0)
        assert process.poll() is None, err_file.read_text()[-2000:]
        os.killpg(process.pid, signal.SIGINT)
        process.communicate(timeout=120)
    text = err_file.read_text()
    assert process.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "terminate called" not in text and "interrupted (SIGINT)" in text, text[-3000:]
    assert _group_gone(process.pid)


@pytest.fixture
def ctrl_c_as_in_a_terminal():
    """SIGINT with Python's own handler for the test, as a terminal's process has it: a suite started in the
    background by a shell without job control (`cmd &`, as CI does) inherits SIGINT ignored (see DRIVER)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_a_signal_that_a_library_turned_into_its_own_error_still_ends_as_the_signal(monkeypatch, capsys):
    """transformers' lazy imports catch the KeyboardInterrupt of a Ctrl-C that lands inside them and raise
    ModuleNotFoundError: the command still ends as interrupted (130, one line), not as a bug report."""
    import argparse

    from rlrunbook import pending_signal

    monkeypatch.setattr(pending_signal, "_received", [])

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at the next bytecode
        except KeyboardInterrupt as error:
            raise ModuleNotFoundError("Could not import module 'BloomPreTrainedModel'.") from error
        return 0

    monkeypatch.setattr(cli_app, "parse_args", lambda argv: argparse.Namespace(func=command))
    code = cli.main(["summarize", "x"])
    err = capsys.readouterr().err
    assert code == 130, err
    assert "interrupted (SIGINT)" in err and "Traceback" not in err and "bug" not in err


def test_without_a_signal_a_library_error_is_still_a_bug_report(monkeypatch, capsys):
    import argparse

    from rlrunbook import pending_signal

    monkeypatch.setattr(pending_signal, "_received", [])

    def command(args):
        raise ModuleNotFoundError("Could not import module 'BloomPreTrainedModel'.")

    monkeypatch.setattr(cli_app, "parse_args", lambda argv: argparse.Namespace(func=command))
    assert cli.main(["summarize", "x"]) == 70
    assert "This is a bug in rlrunbook" in capsys.readouterr().err


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_that_a_library_swallowed_stops_the_command_where_work_begins(monkeypatch, capsys, signum, code):
    """A bare ``except:`` in a module being imported eats the KeyboardInterrupt: the command still stops,
    at its next check point (here: before the command runs), with the signal's status."""
    import argparse

    from rlrunbook import pending_signal

    monkeypatch.setattr(pending_signal, "_received", [])
    ran = []

    def parse_args(argv):
        try:  # what such a module does
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except BaseException:  # noqa: BLE001 - the library's bare except, on purpose
            pass
        return argparse.Namespace(func=lambda args: ran.append(True) or 0)

    monkeypatch.setattr(cli_app, "parse_args", parse_args)
    assert cli.main(["summarize", "x"]) == code
    assert not ran, "the command ran although a signal had been sent"
    assert f"interrupted ({signal.Signals(signum).name})" in capsys.readouterr().err
    assert pending_signal.pending() is None  # handled: the next command of this process starts clean
