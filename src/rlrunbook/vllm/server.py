"""Managed mode: the project starts a vLLM server, waits until it is healthy, restarts it, stops it.

The server runs in its own process group, so stopping it (SIGTERM, then SIGKILL after a grace
period) reaches the API server and every engine process it forked. It also leaves with this
process: on Linux it gets SIGTERM when the thread that started it dies (``PR_SET_PDEATHSIG``, which
covers a crash or SIGKILL of the trainer), and an ``atexit`` hook stops it on a normal exit and
after Ctrl-C. Restarts (every N adapter loads, above a memory limit, or for a larger LoRA rank)
bound the memory a long run's server accumulates, the ``RESTART_EVERY`` knob of earlier local backends.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.vllm.client import VllmClient, VllmServerError, lora_rank_flag

SERVED_MODEL = "base"
_PROGRESS_EVERY_S = 10.0
_STOP_GRACE_S = 20.0
_live: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


@dataclass(frozen=True)
class ServerLaunch:
    """How to start a server: ``command`` (interpreter and module, or a user's command) before the flags."""

    command: tuple[str, ...]
    model_folder: Path
    dtype: str  # float32 | bfloat16 | float16: the trainer's, so that parity can hold
    device: str  # cpu | cuda
    max_model_len: int
    max_loras: int
    kv_cache_gb: float  # CPU build: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float  # CUDA build: the share of GPU memory the server may take
    extra_args: tuple[str, ...]
    scratch: Path  # the server's TMPDIR, caches and logs
    weight_updates: bool = False  # serve vLLM's routes that replace the weights in place (a full-parameter trainer's)


def server_arguments(launch: ServerLaunch, port: int, max_lora_rank: int) -> list[str]:
    """The full command line: processed logprobs, vLLM's neutral generation config, runtime LoRA (one slot more
    than ``max_loras`` for the zero adapter that serves the base model, see :mod:`rlrunbook.vllm.engine`)."""
    args = [
        *launch.command,
        "--model",
        str(launch.model_folder),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        launch.dtype,
        "--max-model-len",
        str(launch.max_model_len),
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank),
        "--max-loras",
        str(launch.max_loras + 1),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        # vLLM 0.32 rewinds a CUDA-only generator offset when a seeded request's prompt is prefilled in
        # chunks, which kills a CPU server's engine ("CPU Generator does not use offset"): prefill whole.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(max(launch.max_model_len, 8192)),
    ]
    if launch.device.startswith("cuda"):
        args += ["--gpu-memory-utilization", str(launch.gpu_memory_utilization)]
    return args + list(launch.extra_args)


def server_environment(launch: ServerLaunch, base: dict[str, str]) -> dict[str, str]:
    """The server's environment (the CPU recipe docs/vllm.md shows); the project's PYTHONPATH stays out."""
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        TMPDIR=str(launch.scratch / "tmp"),
        VLLM_CACHE_ROOT=str(launch.scratch / "cache"),
    )
    if launch.weight_updates:  # /collective_rpc and /reset_prefix_cache (the server listens on loopback only)
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if not launch.device.startswith("cuda"):
        # 1 GiB of KV cache by default; all cores compute (else one is reserved); no torch.compile per new shape.
        env.update(
            VLLM_CPU_KVCACHE_SPACE=f"{launch.kv_cache_gb:g}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            TORCHDYNAMO_DISABLE="1",
        )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs before the server: asks Linux for SIGTERM when the starting thread dies (1 = PR_SET_PDEATHSIG, which
# survives exec), exits if that parent is already gone, then becomes the server. A launcher rather than a
# preexec_fn, which is unsafe in a process with threads.
_LAUNCHER = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _with_parent_death_signal(args: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *args]


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in the group ``pgid`` (Linux ``/proc``), in MiB."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of stat: the process group
                total += int((entry / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return total / 2**20


class ManagedServer:
    """A vLLM server started and owned by this process; see the module docstring."""

    served_model = SERVED_MODEL

    def __init__(
        self,
        launch: ServerLaunch,
        *,
        max_lora_rank: int,
        startup_timeout_s: float,
        restart_every: int = 0,
        max_memory_mb: int = 0,
        log: Callable[[str], None] = print,
    ):
        self.launch = launch
        self.max_lora_rank = lora_rank_flag(max_lora_rank)
        self.startup_timeout_s = startup_timeout_s
        self.restart_every = restart_every
        self.max_memory_mb = max_memory_mb
        self.log = log
        self.epoch = -1
        self.client: VllmClient | None = None
        self._process: subprocess.Popen | None = None
        self._log_path: Path | None = None
        self._loads = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the server and wait until ``/health`` answers; ``VllmServerError`` with the log's tail if not."""
        self.epoch += 1
        port = _free_port()
        for sub in ("tmp", "cache"):
            (self.launch.scratch / sub).mkdir(parents=True, exist_ok=True)
        self._log_path = self.launch.scratch / f"server-{self.epoch}.log"
        args = server_arguments(self.launch, port, self.max_lora_rank)
        self.log(
            f"[vllm] starting a server for {self.launch.model_folder.name} on port {port} "
            f"(max LoRA rank {self.max_lora_rank}); log: {self._log_path}"
        )
        with open(self._log_path, "wb") as log_file:
            try:
                self._process = subprocess.Popen(
                    _with_parent_death_signal(args),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=server_environment(self.launch, dict(os.environ)),
                    start_new_session=True,
                )
            except OSError as error:
                raise VllmServerError(
                    f"cannot run the vLLM server command {args[0]!r}: {error}. Create its venv with "
                    "`bash scripts/setup-vllm.sh` or set TINKER_LOCAL_VLLM_COMMAND."
                ) from None
        _live.add(self)
        self.client = VllmClient(f"http://127.0.0.1:{port}")
        self._loads = 0
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        started = last_note = time.monotonic()
        while not self.client.healthy(timeout_s=2.0):
            if self._process.poll() is not None:
                raise VllmServerError(
                    f"the vLLM server exited with code {self._process.returncode} while starting. "
                    f"{self._log_tail()}"
                )
            now = time.monotonic()
            if now - started > self.startup_timeout_s:
                self.stop()
                raise VllmServerError(
                    f"the vLLM server did not become healthy within {self.startup_timeout_s:.0f} s "
                    f"(TINKER_LOCAL_VLLM_STARTUP_TIMEOUT); it was stopped. {self._log_tail()}"
                )
            if now - last_note >= _PROGRESS_EVERY_S:
                self.log(
                    f"[vllm] waiting for the server to load (pid {self._process.pid}): {now - started:.0f} s "
                    f"of at most {self.startup_timeout_s:.0f} s"
                )
                last_note = now
            time.sleep(0.5)
        self.log(f"[vllm] server ready in {time.monotonic() - started:.1f} s (pid {self._process.pid})")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after the grace period; idempotent."""
        process, self._process = self._process, None
        _live.discard(self)
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and group_rss_mb(process.pid) > 0:
                process.poll()
                time.sleep(0.2)
            if group_rss_mb(process.pid) == 0:
                break
        process.wait(timeout=5.0)

    def restart(self, reason: str) -> None:
        self.log(f"[vllm] restarting the server: {reason}")
        self.stop()
        self.start()

    # -- hooks the engine calls -------------------------------------------------------------
    def before_adapter_load(self, rank: int) -> None:
        """Restart before loading an adapter if its rank is above the server's, if N loads are done, or above the
        memory limit. A dead server is an error here, not a silent restart."""
        if not self.alive():
            raise self.explain(VllmServerError("the vLLM server is not running."))
        if rank > self.max_lora_rank:
            self.max_lora_rank = lora_rank_flag(rank)
            self.restart(f"adapter rank {rank} needs --max-lora-rank {self.max_lora_rank}")
        elif self.restart_every and self._loads >= self.restart_every:
            self.restart(
                f"{self._loads} adapter versions loaded (TINKER_LOCAL_VLLM_RESTART_EVERY={self.restart_every})"
            )
        elif self.max_memory_mb and (rss := group_rss_mb(self._process.pid)) > self.max_memory_mb:
            self.restart(f"{rss:.0f} MiB resident > TINKER_LOCAL_VLLM_MAX_MEMORY_MB={self.max_memory_mb}")

    def adapter_loaded(self) -> None:
        self._loads += 1

    def died(self) -> bool:
        """Whether the server exited on its own (it was not stopped here)."""
        return self._process is not None and self._process.poll() is not None

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def explain(self, error: VllmServerError) -> VllmServerError:
        """``error``, or a clearer one when the server process has died."""
        if self._process is None:
            return error
        try:  # a dropped connection often arrives while the dying server is still exiting
            self._process.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            return error
        code = self._process.returncode
        how = (
            "was killed (SIGKILL: from outside, or the kernel's out-of-memory killer)"
            if code == -9
            else f"exited with code {code}"
        )
        return VllmServerError(
            f"the vLLM server (pid {self._process.pid}) {how} mid-run ({error.detail}). {self._log_tail()}\n"
            "The run directory keeps every finished step; resume from the last checkpoint (rlrunbook train "
            "--resume-from), with TINKER_LOCAL_VLLM_MAX_MEMORY_MB or TINKER_LOCAL_VLLM_RESTART_EVERY if it ran "
            "out of memory."
        )

    def _log_tail(self) -> str:
        """The server log's last error lines (its path when it has none)."""
        if self._log_path is None or not self._log_path.is_file():
            return ""
        text = self._log_path.read_text(errors="replace").splitlines()
        errors = [
            line for line in text if (" ERROR " in line or "Error:" in line) and "Traceback" not in line
        ][-3:]
        if not errors:
            return f"Its log has no error: {self._log_path}."
        return f"Last errors in {self._log_path}:\n" + "\n".join(errors)


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        server.stop()
