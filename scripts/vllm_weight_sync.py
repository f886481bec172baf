"""What it costs a full-parameter run to sample through vLLM: the server's weights replaced after each step.

A full-parameter training client of ``--model`` samples through a managed vLLM server of its own
(``TINKER_LOCAL_SAMPLER=vllm``). Each step trains one cross-entropy datum, then samples ``--rows`` completions of
``--max-tokens`` tokens of the new weights: the first sample call of a version writes every weight as one
safetensors file and the server reloads it in place. Printed per version: the file's size, the seconds to write it
and to reload it, the sample call (reload included) and, for comparison, the same call again (reload done), the
training step, and the largest gap between the server's logprobs and the trainer's of the same tokens:

    python scripts/vllm_weight_sync.py --model smollm2-135m --steps 3

The server runs from ``.venv-vllm`` (``bash scripts/setup-vllm.sh``) or ``RLRUNBOOK_VLLM_VENV``. ``--json FILE``
writes the figures as JSON as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.tokens import build_datum_arrays
from rlrunbook.vllm.settings import VllmSettings

PROMPT = "Question: what is seven times eight? Think about it step by step, then answer."


def _datum(tokenizer) -> types.Datum:
    arrays = build_datum_arrays(tokenizer.encode("What is 7 * 8?"), tokenizer.encode(" The answer is 56."))
    return types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                       loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights})


def _gap(sampler, prompt: list[int], response) -> float:
    """The largest gap between the server's logprobs of its tokens and the trainer's teacher-forced ones."""
    gap = 0.0
    for sequence in response.sequences:
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(sequence.tokens))).result()
        trainer = torch.tensor(scored[-len(sequence.tokens):])
        gap = max(gap, (torch.tensor(sequence.logprobs) - trainer).abs().max().item())
    return gap


def measure(model: str, steps: int, rows: int, max_tokens: int, scratch: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TINKER_LOCAL_VLLM_URL"}
    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=scratch / "tinker", sampler="vllm",
                             vllm=dataclasses.replace(VllmSettings.from_env(env), adapter_dir=scratch / "adapters"))
    service = LocalServiceClient(settings)
    try:
        training = service.create_full_training_client(model)
        engine = training._host.vllm
        tokenizer = training.get_tokenizer()
        prompt = tokenizer.encode(PROMPT)
        datum = _datum(tokenizer)
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7)
        versions = []
        for version in range(steps + 1):
            step_s = None
            if version:
                started = time.perf_counter()
                training.forward_backward([datum], "cross_entropy").result()
                training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                step_s = time.perf_counter() - started
            sampler = training.save_weights_and_get_sampling_client()
            started = time.perf_counter()
            response = sampler.sample(types.ModelInput.from_ints(prompt), rows, params).result()
            first_s = time.perf_counter() - started
            started = time.perf_counter()
            sampler.sample(types.ModelInput.from_ints(prompt), rows, params).result()
            again_s = time.perf_counter() - started
            sync = engine.adapters.weight_syncs[-1]
            versions.append({"version": version, "file_mb": sync.bytes / 2**20, "write_s": sync.write_s,
                             "reload_s": sync.reload_s, "sample_s": first_s, "sample_again_s": again_s,
                             "train_step_s": step_s, "gap": _gap(sampler, prompt, response)})
        assert engine.adapters.weight_reloads == steps + 1, "one reload per version"
        return {"model": model, "parameters": sum(p.numel() for p in training._host.model.parameters()),
                "dtype": "float32", "rows": rows, "max_tokens": max_tokens, "machine": _machine(),
                "versions": versions}
    finally:
        service.close()


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def report(result: dict) -> str:
    lines = [(f"{result['model']} ({result['parameters'] / 1e6:.1f}M parameters, {result['dtype']}), "
              f"{result['rows']} rows x {result['max_tokens']} tokens per sample call; {result['machine']}"),
             "version  file MiB  write s  reload s  sample s (first / again)  train step s  sampler-trainer gap"]
    for v in result["versions"]:
        step = "-" if v["train_step_s"] is None else f"{v['train_step_s']:.2f}"
        lines.append(f"{v['version']:>7}  {v['file_mb']:>8.1f}  {v['write_s']:>7.2f}  {v['reload_s']:>8.2f}  "
                     f"{v['sample_s']:>10.2f} / {v['sample_again_s']:<9.2f}  {step:>12}  {v['gap']:.1e}")
    later = result["versions"][1:] or result["versions"]
    lines.append(f"median after a step: write {statistics.median(v['write_s'] for v in later):.2f} s, reload "
                 f"{statistics.median(v['reload_s'] for v in later):.2f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlrunbook-weight-sync-") as scratch:
        result = measure(args.model, args.steps, args.rows, args.max_tokens, Path(scratch))
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
