"""What the wire costs, and what several clients get: ``rlrunbook serve`` against the backend in process.

1. Per-call overhead. The peer workload's two calls (tests/benchmarks/peer_workload.py: SmolLM2-135M, 4 chat
   prompts x 4 samples of up to 64 tokens, LoRA r16 on the 7 projections): ``sample`` (the 4 prompts at once) and
   ``forward_backward`` (importance sampling on the 16 sampled rows), timed on a ``LocalServiceClient`` in this
   process and through the unmodified Tinker SDK against a server on this machine, alternating A, B, A, B, ... so
   both see the same machine state; medians and their ratio.
2. Concurrent clients. 1, 2 and 4 SDK clients (one training client each, their own processes' worth of threads
   here: one thread each) run the peer step (sample, forward_backward, optim_step) against one server at once;
   steps per minute in all, and each client's median step.

    python scripts/serve_bench.py                       # smollm2-135m, 5 repeats, clients 1 2 4
    python scripts/serve_bench.py --model tiny --json serve.json

The server is started and stopped here (a temporary storage, a key); numbers are this machine's, say which.
Both sides run with the allocator settings ``rlrunbook serve`` applies to itself (``keep_freed_memory``), so the
in-process side is not the one re-faulting its activation buffers every step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))

KEY = "tml-serve-bench-key"


def _peer():
    import peer_workload

    return peer_workload


def _prompts(tokenizer) -> list[list[int]]:
    from rlrunbook.rl.rollout.prompts import render_prompt

    return [render_prompt(tokenizer, question) for question in _peer().PROMPTS]


class Workload:
    """The peer workload's calls on one training client of either ServiceClient."""

    def __init__(self, service, model: str, seed: int):
        peer = _peer()
        self.peer = peer
        self.shape = peer.peer_shape()  # RLRUNBOOK_PEER_SHAPE, else 4 prompts x 4 samples x 64 tokens
        self.training = service.create_lora_training_client(model, rank=peer.RANK, seed=seed,
                                                            train_unembed=False).result()
        self.tokenizer = self.training.get_tokenizer()
        self.prompts = _prompts(self.tokenizer)[:self.shape.prompts]
        self.step_index = 0

    def sample(self):
        from tinker import types

        sampler = self.training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=self.shape.max_tokens, temperature=1.0, top_p=1.0,
                                      seed=self.step_index)
        futures = [sampler.sample(types.ModelInput.from_ints(p), self.shape.samples, params) for p in self.prompts]
        return [future.result().sequences for future in futures]

    def datums(self, groups):
        from tinker import types

        data = []
        for prompt, sequences in zip(self.prompts, groups, strict=True):
            rewards = [self.peer.reward(self.tokenizer.decode(list(s.tokens), skip_special_tokens=True))
                       for s in sequences]
            mean = sum(rewards) / len(rewards)
            for sequence, value in zip(sequences, rewards, strict=True):
                tokens, full = list(sequence.tokens), prompt + list(sequence.tokens)
                n_prompt = len(prompt) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * n_prompt + list(sequence.logprobs),
                                    "advantages": [0.0] * n_prompt + [value - mean + 1e-3] * len(tokens)}))
        return data

    def forward_backward(self, data):
        return self.training.forward_backward(data, "importance_sampling").result()

    def step(self) -> float:
        from tinker import types

        started = time.perf_counter()
        data = self.datums(self.sample())
        self.forward_backward(data)
        self.training.optim_step(types.AdamParams(learning_rate=self.peer.LR, grad_clip_norm=self.peer.CLIP)).result()
        self.step_index += 1
        return time.perf_counter() - started


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def overhead(local: Workload, wire: Workload, repeats: int) -> dict:
    """Median seconds of sample and forward_backward per side, alternating; one warm-up call each first."""
    data_local, data_wire = local.datums(local.sample()), wire.datums(wire.sample())  # warm-up, and the data
    local.forward_backward(data_local)
    wire.forward_backward(data_wire)
    times: dict[str, list[float]] = {"sample/in_process": [], "sample/wire": [], "forward_backward/in_process": [],
                                     "forward_backward/wire": []}
    for _ in range(repeats):
        times["sample/in_process"].append(timed(local.sample))
        times["sample/wire"].append(timed(wire.sample))
        times["forward_backward/in_process"].append(timed(lambda: local.forward_backward(data_local)))
        times["forward_backward/wire"].append(timed(lambda: wire.forward_backward(data_wire)))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for call in ("sample", "forward_backward"):
        medians[f"{call}/ratio"] = medians[f"{call}/wire"] / medians[f"{call}/in_process"]
    return {"medians_s": medians, "samples_s": times}


def concurrent(url: str, model: str, clients: int, steps: int) -> dict:
    """``clients`` SDK clients at once, ``steps`` peer steps each (after one warm-up step each)."""
    import tinker

    workloads = [Workload(tinker.ServiceClient(base_url=url, api_key=KEY), model, seed=index)
                 for index in range(clients)]
    for workload in workloads:
        workload.step()  # warm-up: engine caches of each client
    durations: list[list[float]] = [[] for _ in workloads]
    barrier = threading.Barrier(clients)

    def run(index: int) -> None:
        barrier.wait()
        for _ in range(steps):
            durations[index].append(workloads[index].step())

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    elapsed = time.perf_counter() - started
    return {"clients": clients, "steps": clients * steps, "elapsed_s": elapsed,
            "steps_per_min": 60 * clients * steps / elapsed,
            "median_step_s": statistics.median([d for each in durations for d in each])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5, help="alternating timed calls per side (5)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per client (3)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    import tinker
    import torch

    from rlrunbook.backend import LocalServiceClient, LocalSettings
    from rlrunbook.service.server import keep_freed_memory
    from rlrunbook.testing.serve import start_server

    keep_freed_memory()  # as the server does for itself

    storage = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    env = {**os.environ, "TINKER_LOCAL_DEVICE": os.environ.get("TINKER_LOCAL_DEVICE", "cpu"),
           "TINKER_LOCAL_LORA_ALPHA": str(_peer().ALPHA)}
    server = start_server(storage / "server", "--api-key", KEY, env=env)
    local = LocalServiceClient(LocalSettings.from_env({**env, "TINKER_LOCAL_STORAGE": str(storage / "local")}))
    try:
        print(f"[serve-bench] {args.model}; server {server.url}; {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
        result = {"model": args.model, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                  "date": time.strftime("%Y-%m-%d"),
                  "overhead": overhead(Workload(local, args.model, 0),
                                       Workload(tinker.ServiceClient(base_url=server.url, api_key=KEY),
                                                args.model, 0), args.repeats)}
        for name, value in result["overhead"]["medians_s"].items():
            print(f"  {name:32s} {value:8.3f}", flush=True)
        local.close()
        result["concurrent"] = []
        for clients in args.clients:
            figures = concurrent(server.url, args.model, clients, args.steps)
            result["concurrent"].append(figures)
            print(f"  {clients} client(s): {figures['steps_per_min']:.2f} steps/min in all, median step "
                  f"{figures['median_step_s']:.2f} s", flush=True)
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
