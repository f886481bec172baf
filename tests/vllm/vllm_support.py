"""Shared pieces of the vLLM tier: prompts of different lengths, a trained adapter, vLLM processes."""

from __future__ import annotations

import os
from pathlib import Path

from tinker import types

from rlrunbook.testing.prompts import chat_prompts as shared_chat_prompts
from rlrunbook.tokens import build_datum_arrays


def chat_prompts(tokenizer, n: int = 6) -> list[list[int]]:
    """The first ``n`` of the shared chat prompts (six by default: enough rows for a vLLM batch on a CPU)."""
    return shared_chat_prompts(tokenizer, n)


def supervised_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """A cross-entropy datum that teaches ``answer`` after ``prompt``."""
    arrays = build_datum_arrays(tokenizer.encode(prompt), tokenizer.encode(answer))
    return types.Datum(
        model_input=types.ModelInput.from_ints(arrays.input_tokens),
        loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights},
    )


def train_steps(training, steps: int, learning_rate: float = 1e-2) -> None:
    """Move the adapter away from its zero-B start with a few cross-entropy steps."""
    datum = supervised_datum(training.get_tokenizer(), "What is 7 * 8?", " The answer is 56.")
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()


def vllm_pids() -> set[int]:
    """Processes that belong to a vLLM server: its API server, engine core and workers (Linux /proc)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"vllm.entrypoints" in cmdline or cmdline.startswith(b"VLLM::") or b"venv-vllm" in cmdline:
                pids.add(int(entry.name))
    return pids - {os.getpid()}


def kill_and_wait(pids: set[int], timeout: float = 30.0) -> None:
    """SIGKILL each process group in ``pids`` and wait until every process has exited (gone or a zombie).

    SIGKILL is asynchronous: a server holding gigabytes takes a moment to unmap them, and a caller that asks
    "is it alive?" right after the signal can still hear yes."""
    import signal
    import time

    for pid in pids:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_running(pid) for pid in pids):
            return
        time.sleep(0.05)
    raise TimeoutError(
        f"processes {sorted(p for p in pids if _running(p))} still run {timeout:.0f} s after SIGKILL"
    )


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
