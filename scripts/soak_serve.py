"""Soak ``rlrunbook serve``: many SDK clients for minutes; the server's memory and storage must stay flat.

Starts ``rlrunbook serve`` on a temporary storage (loopback, one key) and runs ``--clients`` SDK client loops
against it until ``--minutes`` have passed. Each pass of a loop is one whole client life: a ``ServiceClient``
(a session), a LoRA training client on ``--model``, ``forward_backward`` and ``optim_step`` twice, a saved state
and saved sampler weights (each with a TTL), a sampling client of the saved weights and one ``sample``, both
checkpoints deleted, the ``ServiceClient`` closed. Local checkpoints are not deleted when their TTL passes
(``set_checkpoint_ttl`` records it only; the shortest TTL the SDK accepts is an hour, longer than a soak), so
the loops delete what they saved, as a client that cleans up does.

Every ``--every`` seconds it samples the server's resident set (``/proc/<pid>/status`` VmRSS) and the bytes
under its storage folder, prints a table, and ends with a verdict: after the first ``--warmup`` seconds, the
growth of each (the median of the last quarter of the samples minus the sample at the end of the warm-up) must
stay within ``--rss-tolerance`` (a fraction of the warm-up RSS) and ``--storage-tolerance-mib``. Exit 0 when
both hold, 1 otherwise.

    python scripts/soak_serve.py                              # 16 clients, 10 minutes, tiny
    python scripts/soak_serve.py --clients 4 --minutes 1.5 --every 3 --json soak.json

The clients run as threads of this process; numbers are this machine's, say which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

KEY = "tml-soak-serve-key"
TTL_S = 3600  # the SDK's shortest TTL
MIB = 2**20


@dataclass
class Sample:
    """One measurement: seconds since the clients started, the server's RSS and its storage's bytes."""

    t_s: float
    rss_bytes: int
    storage_bytes: int
    lives: int  # client lives (ServiceClient to close) completed so far
    calls: int  # calls answered so far


@dataclass
class Soak:
    clients: int
    minutes: float
    model: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def folder_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:  # removed while walking (a checkpoint deleted, a rename)
                pass
    return total


def _datum(tokens: list[int]):
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                                       "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32")})


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lives = 0
        self.calls = 0

    def add(self, lives: int = 0, calls: int = 0) -> None:
        with self.lock:
            self.lives += lives
            self.calls += calls


def client_loop(url: str, model: str, index: int, deadline: float, counters: Counters, errors: list[str]) -> None:
    """Client lives, one after another, until ``deadline`` (a life that started before it finishes)."""
    import tinker
    from tinker import types

    data = [_datum([(7 * index + 3 * row + j) % 200 + 3 for j in range(48)]) for row in range(4)]
    life = 0
    while time.monotonic() < deadline:
        try:
            service = tinker.ServiceClient(base_url=url, api_key=KEY)
            training = service.create_lora_training_client(base_model=model, rank=4, seed=index).result()
            for _ in range(2):
                training.forward_backward(data, "cross_entropy").result()
                training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            state = training.save_state(f"soak-{index}-{life}", ttl_seconds=TTL_S).result().path
            weights = training.save_weights_for_sampler(f"soak-{index}-{life}-w", ttl_seconds=TTL_S).result().path
            sampler = service.create_sampling_client(model_path=weights).result()
            params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=life)
            sampler.sample(types.ModelInput.from_ints(data[0].model_input.to_ints()[:8]), 2, params).result()
            rest = tinker.RestClient(base_url=url, api_key=KEY)
            for path in (state, weights):
                rest.delete_checkpoint_from_tinker_path(path).result()
            service.close("success").result()
            counters.add(lives=1, calls=10)
        except Exception as error:  # noqa: BLE001 - counted and reported; the soak goes on
            errors.append(f"client {index} life {life}: {type(error).__name__}: {str(error)[:300]}")
        life += 1


def growth(samples: list[Sample], warmup_s: float, key: str) -> tuple[int, int]:
    """``(value at the end of the warm-up, median of the last quarter minus it)`` of ``key``."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 4:
        raise RuntimeError(f"only {len(after)} samples after the {warmup_s:g} s warm-up; run longer or sample "
                           "more often (--every).")
    start = getattr(after[0], key)
    tail = after[-max(2, len(after) // 4):]
    return start, int(statistics.median(getattr(s, key) for s in tail)) - start


def verdict(soak: Soak, warmup_s: float, rss_tolerance: float, storage_tolerance_mib: float) -> tuple[bool, list[str]]:
    rss_start, rss_growth = growth(soak.samples, warmup_s, "rss_bytes")
    storage_start, storage_growth = growth(soak.samples, warmup_s, "storage_bytes")
    rss_ok = rss_growth <= rss_tolerance * rss_start
    storage_ok = storage_growth <= storage_tolerance_mib * MIB
    lines = [
        (f"RSS: {rss_start / MIB:.1f} MiB at {warmup_s:g} s, then {rss_growth / MIB:+.1f} MiB "
         f"({rss_growth / rss_start:+.1%}); tolerance {rss_tolerance:.0%}: {'flat' if rss_ok else 'GROWS'}"),
        (f"storage: {storage_start / MIB:.2f} MiB at {warmup_s:g} s, then {storage_growth / MIB:+.2f} MiB; "
         f"tolerance {storage_tolerance_mib:g} MiB: {'flat' if storage_ok else 'GROWS'}"),
    ]
    return rss_ok and storage_ok, lines


def run_soak(clients: int, minutes: float, model: str, every_s: float, storage: Path,
             out=sys.stdout) -> Soak:
    """Start the server on ``storage``, run the clients for ``minutes``, sample every ``every_s``; stop it."""
    from rlrunbook.testing.serve import start_server

    soak = Soak(clients, minutes, model)
    server = start_server(storage, "--api-key", KEY, "--max-sessions", str(4 * clients),
                          "--max-models", str(4 * clients))
    counters = Counters()
    start = time.monotonic()
    deadline = start + minutes * 60
    threads = [threading.Thread(target=client_loop, args=(server.url, model, i, deadline, counters, soak.errors),
                                daemon=True) for i in range(clients)]
    try:
        for thread in threads:
            thread.start()
        print(f"{'t (s)':>7} {'RSS (MiB)':>10} {'storage (MiB)':>14} {'lives':>6} {'calls':>6}", file=out, flush=True)
        next_at = start
        while any(thread.is_alive() for thread in threads):
            now = time.monotonic()
            if now >= next_at:
                sample = Sample(round(now - start, 1), rss_bytes(server.process.pid), folder_bytes(storage),
                                counters.lives, counters.calls)
                soak.samples.append(sample)
                print(f"{sample.t_s:>7.1f} {sample.rss_bytes / MIB:>10.1f} {sample.storage_bytes / MIB:>14.2f} "
                      f"{sample.lives:>6} {sample.calls:>6}", file=out, flush=True)
                next_at += every_s
            time.sleep(min(0.2, max(0.0, next_at - time.monotonic())))
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    return soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent SDK client loops (16)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients run (10)")
    parser.add_argument("--model", default="tiny", help="the base model every client trains (tiny)")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples (5)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before growth counts (60)")
    parser.add_argument("--rss-tolerance", type=float, default=0.10,
                        help="RSS growth allowed after the warm-up, as a fraction of its RSS then (0.10)")
    parser.add_argument("--storage-tolerance-mib", type=float, default=4.0,
                        help="storage growth allowed after the warm-up, in MiB (4)")
    parser.add_argument("--json", metavar="FILE", help="also write the samples and the verdict here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory(prefix="rlrunbook-soak-") as scratch:
        soak = run_soak(args.clients, args.minutes, args.model, args.every, Path(scratch) / "storage")
    ok, lines = verdict(soak, args.warmup, args.rss_tolerance, args.storage_tolerance_mib)
    last = soak.samples[-1]
    print(f"{args.clients} clients, {args.minutes:g} min on {args.model}: {last.lives} client lives, "
          f"{last.calls} calls, {len(soak.errors)} error(s)")
    for line in [*lines, *soak.errors[:10]]:
        print(line)
    print("verdict:", "flat" if ok and not soak.errors else "NOT FLAT" if not ok else "ERRORS")
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(soak), "verdict": lines, "ok": ok}, indent=1))
    return 0 if ok and not soak.errors else 1


if __name__ == "__main__":
    sys.exit(main())
