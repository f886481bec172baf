"""Parity by construction, measured: does a sequence's logprob depend on anything but its tokens and the weights?

    python scripts/invariance_check.py                                  # SmolLM2-135M, bf16, CPU
    python scripts/invariance_check.py --dtype float32 --json out.json
    python scripts/invariance_check.py --device cuda                    # on a GPU (Triton kernels)

At the default numerics (``invariant``), 12 sequences of different lengths (48-136 tokens, LoRA rank 32) are
scored by the trainer's ``forward``:

1. as one batch, as shuffled batches of 4, and one by one: the logprobs must be bitwise equal;
2. in fresh processes with ``OMP_NUM_THREADS=1`` and ``2`` (CPU), and with oneDNN switched off
   (``torch.backends.mkldnn``): bitwise equal to 1;
3. the sampler against the trainer: 16 samples x 128 tokens at T = 1 and at T = 0.7 with top-p 0.9, max |Δ|;
4. the time of ``forward_backward`` on the 12 sequences and of a sampling call of 16 rows x 64 tokens per decode
   step (prefill and draws included), default against ``native`` numerics (PyTorch's own kernels), alternating,
   median of ``--repeats`` (``--against exact`` compares with the float64 reference instead).

Prints one line per check and exits 1 when any equality fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

LENGTHS = [48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136]
PROMPT = "Write a short story about a cat and a dog who become friends."


def _datums(vocab: int):
    from tinker import types

    from rlrunbook.tokens import build_datum_arrays

    generator = torch.Generator().manual_seed(0)
    data = []
    for index, length in enumerate(LENGTHS):
        ids = torch.randint(100, min(vocab, 20000), (length,), generator=generator).tolist()
        arrays = build_datum_arrays(ids[: length // 2], ids[length // 2:], None,
                                    [1.0 if index % 2 else -1.0] * (length - length // 2))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                loss_fn_inputs={"target_tokens": arrays.target_tokens,
                                                "weights": [1.0] * len(arrays.target_tokens)}))
    return data


def _service(args, numerics: str):
    from rlrunbook.backend import LocalServiceClient, LocalSettings

    settings = LocalSettings(device=args.device, dtype=getattr(torch, args.dtype), numerics=numerics,
                             storage_dir=Path(tempfile.mkdtemp(prefix="invariance-")))
    return LocalServiceClient(settings)


def _logprobs(client, data) -> list[list[float]]:
    out = client.forward(data, "cross_entropy").result().loss_fn_outputs
    return [item["logprobs"].tolist() for item in out]


def _compositions(client, data) -> dict[str, list[list[float]]]:
    order = list(range(len(data)))
    random.Random(0).shuffle(order)
    shuffled: list = [None] * len(data)
    for start in range(0, len(order), 4):
        part = order[start:start + 4]
        for index, values in zip(part, _logprobs(client, [data[i] for i in part]), strict=True):
            shuffled[index] = values
    return {"one batch": _logprobs(client, data), "shuffled batches of 4": shuffled,
            "one by one": [_logprobs(client, [datum])[0] for datum in data]}


def _emit(args) -> None:
    """In a child process: the one-batch logprobs, as JSON on stdout."""
    with _service(args, "invariant") as service:
        client = service.create_lora_training_client(args.model, rank=32, seed=0)
        print(json.dumps(_logprobs(client, _datums(client.get_tokenizer().vocab_size))))


def _child(args, threads: int) -> list[list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--emit", "--model", args.model, "--dtype", args.dtype, "--device",
               args.device]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _seconds(run, repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``run`` (the device synchronised after each)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", default="native", choices=("native", "exact"),
                        help="the numerics the default's time is compared with")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emit:
        _emit(args)
        return 0

    from rlrunbook.diagnostics import parity_gates, sampler_trainer_parity
    from rlrunbook.engines.filters import SamplingFilters

    report: dict = {"model": args.model, "dtype": args.dtype, "device": args.device, "torch": torch.__version__,
                    "threads": torch.get_num_threads()}
    failures = []
    with _service(args, "invariant") as service:
        client = service.create_lora_training_client(args.model, rank=32, seed=0)
        tokenizer = client.get_tokenizer()
        data = _datums(tokenizer.vocab_size)
        compositions = _compositions(client, data)
        reference = compositions["one batch"]
        equal = {name: values == reference for name, values in compositions.items()}
        if args.device == "cpu":
            with warnings.catch_warnings():
                # torch 2.13 warns, when any oneDNN flag is set, that TF32 needs an Intel GPU: not relevant here
                warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
                with torch.backends.mkldnn.flags(enabled=False):
                    equal["oneDNN off"] = _logprobs(client, data) == reference
            for threads in (1, 2):
                equal[f"OMP_NUM_THREADS={threads} (new process)"] = _child(args, threads) == reference
        for name, same in equal.items():
            print(f"[invariance] {name}: {'bitwise equal' if same else 'DIFFERENT'} to one batch "
                  f"({sum(map(len, reference))} logprobs)", flush=True)
            if not same:
                failures.append(name)
        report["equal"] = equal

        sampler = client.save_weights_and_get_sampling_client()
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        report["parity"] = {}
        for filters in (SamplingFilters(1.0), SamplingFilters(0.7, top_p=0.9)):
            gates = parity_gates(getattr(torch, args.dtype), filters.temperature)
            parity = sampler_trainer_parity(client, sampler, prompt, 16, 128, filters, 0, gates)
            label = f"T={filters.temperature}" + (f" top-p {filters.top_p}" if filters.top_p < 1 else "")
            print(f"[invariance] sampler vs trainer {label}: {parity.num_tokens} tokens, max |d| "
                  f"{parity.max_abs_diff:.3g}, mean {parity.mean_abs_diff:.3g}", flush=True)
            report["parity"][label] = {"tokens": parity.num_tokens, "max": parity.max_abs_diff,
                                       "mean": parity.mean_abs_diff}
            if parity.max_abs_diff != 0.0:
                failures.append(f"sampler vs trainer {label}")

    report["seconds"] = _timings(args, data)
    for what, figures in report["seconds"].items():
        ratio = statistics.median(figures["invariant"]) / statistics.median(figures[args.against])
        figures["ratio"] = ratio
        print(f"[invariance] {what}: invariant {statistics.median(figures['invariant']):.4g} s, {args.against} "
              f"{statistics.median(figures[args.against]):.4g} s (medians of {args.repeats}): x{ratio:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if failures:
        print(f"[invariance] FAILED: {', '.join(failures)}")
        return 1
    print("[invariance] every check bitwise equal")
    return 0


def _timings(args, data) -> dict:
    """forward_backward and decode-step seconds, the two numerics alternating."""
    from tinker import types

    services = {name: _service(args, name) for name in ("invariant", args.against)}
    try:
        clients = {name: service.create_lora_training_client(args.model, rank=32, seed=0)
                   for name, service in services.items()}
        samplers = {name: client.save_weights_and_get_sampling_client() for name, client in clients.items()}
        prompt = types.ModelInput.from_ints(list(range(1000, 1032)))
        params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=1)
        figures = {"forward_backward (12 sequences)": {name: [] for name in services},
                   "sampling, per decode step (16 rows x 64 tokens)": {name: [] for name in services}}
        for name, client in clients.items():  # warm-up: kernels compiled, caches and graphs built
            client.forward_backward(data, "cross_entropy").result()
            samplers[name].sample(prompt, 16, params).result()
        for _ in range(args.repeats):
            for name, client in clients.items():
                figures["forward_backward (12 sequences)"][name] += _seconds(
                    lambda c=client: c.forward_backward(data, "cross_entropy").result(), 1)
                engine = samplers[name]._host.engine
                steps = engine.decode_steps
                seconds = _seconds(lambda s=samplers[name]: s.sample(prompt, 16, params).result(), 1)[0]
                figures["sampling, per decode step (16 rows x 64 tokens)"][name].append(
                    seconds / max(1, engine.decode_steps - steps))
        return figures
    finally:
        for service in services.values():
            service.close()


if __name__ == "__main__":
    sys.exit(main())
