"""Processes of a test that play the ranks of a torchrun launch, or a plain process beside it.

A child gets this process's environment without any launch variables of its own (a test may itself run under
torchrun), this checkout's ``src`` first on ``PYTHONPATH`` (the code under test, not an installed copy) and one
thread (float32 results depend on the thread count's blocking; one thread makes bitwise comparisons possible).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import rlrunbook

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process (see the module docstring), with ``extra`` on top."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    src = str(Path(rlrunbook.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_envs(world: int) -> list[dict[str, str]]:
    """The environments of ``world`` ranks meeting on one free loopback port; one plain process for ``world`` 1."""
    if world == 1:
        return [child_env()]
    port = str(free_port())
    return [child_env(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port) for rank in range(world)]


def start(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]]) -> list[subprocess.Popen]:
    """One process per command, with its environment, each in a session of its own (a launcher and the workers it
    starts go together), its output captured as text."""
    return [subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True) for command, env in zip(commands, envs, strict=True)]


def finish(procs: Sequence[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Wait for every process (``timeout`` seconds each); whatever still runs then is killed with its session, so a
    hung rank fails the test instead of leaving processes behind. Their outputs and exit statuses."""
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return done


def run(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
        timeout: float) -> list[subprocess.CompletedProcess]:
    """:func:`start` then :func:`finish`, asserting that every process exited 0 (the failing one's output shown)."""
    done = finish(start(commands, envs), timeout)
    for index, result in enumerate(done):
        assert result.returncode == 0, (f"process {index} of {len(done)} exited {result.returncode}:\n"
                                        f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return done
