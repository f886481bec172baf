"""One whole step of the RLVR preset's shape on one device, against its memory plan (``gpu-check.sh --part scale``).

The model is Qwen2.5-Math-1.5B's architecture built from its published config values with random weights (no
download), LoRA rank 64 as the preset trains it. The step: 64 prompts of 1,024 random tokens, 4 samples each,
up to 1,536 new tokens (no stop: every row runs to the end), through the in-process engine; then
``forward_backward`` of the 256 datums in the planned micro-batches and one optimizer step. Then a decode
benchmark at 64 rows x 256 positions (first; ``--decode-rows 0`` leaves it out). Written to ``OUT/scale.json``:

    python scripts/scale_check.py --out DIR                       # the full shape, on cuda
    python scripts/scale_check.py --out DIR --device cpu --layers 2 --groups 2 --samples 2 --prompt 64 --new 16

Reported: seconds per phase and of the whole step (``step_s``: sampling through the optimizer step), peak memory (``torch.cuda.max_memory_allocated``; on CPU the traced tensor peak is
not measured here) against the plan's sampling and training peaks, decode ms per step, trained tokens per second
and the MFU of the forward/backward (:func:`lora_training_flops`, :func:`full_training_flops`, against 989 TFLOP/s:
an H100's dense bf16). ``--config-file h100-rlvr-full``: the same step training every weight (float32 master
weights sharded over a one-rank group, bf16 passes, the KL reference copy), planned as that preset.
``--model`` another model of the preset's kind (``tiny`` for a quick check; the plan is then for it).

The gate: a measured peak above the plan's is a plan that would not have kept the memory it promised; the script
then exits 1 naming both numbers (after writing ``scale.json``, which records the verdict as ``plan_failures``).
Where no peak is measured (on CPU) there is nothing to gate, and the JSON says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from tinker import types

from rlrunbook.backend import sharding
from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.backend.memory import model_bytes, with_layers
from rlrunbook.backend.trainer import Trainer
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.models.shapes import model_shape
from rlrunbook.rl.setup.config_sources import build_config
from rlrunbook.rl.setup.memory_plan import format_plan, parse_size, plan_memory

H100_BF16_FLOPS = 989e12


def lora_training_flops(product_params: int, tokens: int) -> float:
    """FLOPs of one LoRA ``forward_backward`` over ``tokens`` input positions: 4 x frozen product parameters x tokens.

    Per position and frozen weight: 2 in the forward product, 2 in the backward product for the input's gradient; a
    frozen weight has no weight gradient. Not counted: the adapters' own products, attention's score and value
    products, and recomputed layers (activation checkpointing), so the MFU it gives is a lower bound.
    """
    return 4.0 * product_params * tokens


def full_training_flops(product_params: int, tokens: int, recompute_layers: bool) -> float:
    """FLOPs of one full-parameter ``forward_backward`` over ``tokens`` positions: 6 x product parameters x tokens
    (2 forward, 2 for the input's gradient, 2 for the weight's), 8 x with activation checkpointing (one more
    forward). Attention's score and value products are not counted: the MFU it gives is a lower bound."""
    return (8.0 if recompute_layers else 6.0) * product_params * tokens


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str) -> int | None:
    return int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None


def decode_ms_per_step(model, config, *, rows: int, prompt_tokens: int, new_tokens: int, device: str,
                       generator: torch.Generator, repeats: int = 1) -> float:
    """Milliseconds per decode step of the in-process engine: ``rows`` random prompts of ``prompt_tokens``, one
    sample each, ``new_tokens`` new tokens (no stop, temperature 0.6). After a warm-up call (caches, graph captures),
    the median over ``repeats`` calls of (wall time - the engine's prefill seconds) / its decode steps. The engine
    and its cache are released before returning."""
    import statistics

    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=config.vocab_size,
                              max_context=config.max_position_embeddings)
    prompts = [torch.randint(3, config.vocab_size, (prompt_tokens,), generator=generator).tolist() for _ in range(rows)]
    request = GenerationRequest(max_tokens=new_tokens, filters=SamplingFilters(0.6), stop=(), seed=1)
    engine.sample_jobs([SampleJob(p, 1, request) for p in prompts])  # warm-up
    timed = []
    for _ in range(repeats):
        _sync(device)
        before, steps, prefill = time.perf_counter(), engine.decode_steps, engine.prefill_seconds
        engine.sample_jobs([SampleJob(p, 1, request) for p in prompts])
        _sync(device)
        elapsed = time.perf_counter() - before - (engine.prefill_seconds - prefill)
        timed.append(1000 * elapsed / max(1, engine.decode_steps - steps))
    del engine  # its cache is not part of what follows
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(timed)


PHASES = (("sampling", "sampling_peak_bytes", "planned_sampling_peak"),
          ("training", "training_peak_bytes", "planned_training_peak"))


def plan_failures(report: dict) -> list[str]:
    """One line per phase whose measured peak (bytes) is above the plan's, naming both; phases not measured (CPU, or
    not reached before the time budget) are not judged."""
    gib = 1 << 30
    failures = []
    for phase, measured, planned in PHASES:
        if report.get(measured) is not None and report[measured] > report[planned]:
            failures.append(f"{phase} peak {report[measured] / gib:.2f} GiB measured is above the plan's "
                            f"{report[planned] / gib:.2f} GiB ({report[measured]} > {report[planned]} bytes): the "
                            "memory plan is too low (rlrunbook/rl/setup/memory_plan.py)")
    return failures


def judge(report: dict, out: Path) -> int:
    """Record the plan's verdict in ``scale.json`` and print it; the exit status: 1 when a peak is above its plan."""
    failures = plan_failures(report)
    measured = [phase for phase, key, _ in PHASES if report.get(key) is not None]
    report["plan_failures"] = failures
    report["plan_judged"] = measured
    (out / "scale.json").write_text(json.dumps(report, indent=1))
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    if not measured:
        print("plan not judged: no peak measured on this device", file=sys.stderr)
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="Qwen/Qwen2.5-Math-1.5B", help="the preset's model by default")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's 28")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=1536)
    parser.add_argument("--decode-rows", type=int, default=64, help="0: no decode benchmark")
    parser.add_argument("--decode-window", type=int, default=256)
    parser.add_argument("--device-memory", default=None, help="plan for this size (default: the device's)")
    parser.add_argument("--config-file", default="h100-rlvr",
                        help="the preset planned and trained: h100-rlvr (LoRA r64) or h100-rlvr-full (every weight)")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, out: Path) -> dict:
    """Plan, then run the step and the decode benchmark, writing ``out/scale.json`` after each phase; the report."""
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    report: dict = {"device": args.device, "dtype": str(dtype).removeprefix("torch."),
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                    "torch": torch.__version__}

    config = model_shape(args.model)[0]
    if args.layers:
        config = with_layers(config, args.layers)
    rows = args.groups * args.samples
    run = build_config(file=args.config_file, overrides=[
        f"num_rollouts={rows}", f"num_groups={args.groups}", f"max_tokens={args.new}",
        f"data.max_prompt_tokens={args.prompt}", f"backend.device={args.device}",
        f"backend.dtype={report['dtype']}", f"model={args.model}"], cli={}, strict=False).config
    if args.layers:  # plan the cut model: a local folder would do; the published config has 28 layers
        report["note"] = f"{args.layers} of the model's layers; the plan is for all of them"
    plan = plan_memory(run, parse_size(args.device_memory) if args.device_memory else None)
    report["plan"] = format_plan(plan)
    report["planned_sampling_peak"], report["planned_training_peak"] = plan.sampling_peak, plan.training_peak

    def save() -> None:  # after each phase: a run stopped by its time budget still reports what it finished
        (out / "scale.json").write_text(json.dumps(report, indent=1))

    save()

    started = time.perf_counter()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    with torch.device(args.device):  # random weights made on the device: no host copy of 3 GB
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    full = run.finetune == "full"
    report["finetune"] = run.finetune
    product_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    reference = None
    if full:  # float32 master weights sharded over a one-rank group, passes in dtype (backend/sharding.py)
        reference = copy.deepcopy(model) if run.loss.kl_coef > 0 else None
        sharding.shard(model, dtype)
        if reference is not None:
            sharding.shard_reference(reference)
        report["weights_bytes"] = sum(sharding.local_bytes(p) for p in sharding.sharded_parameters(model).values())
        trainer = Trainer(model, pad_token_id=0, vocab_size=config.vocab_size, full_parameters=True,
                          reference=reference, micro_batch_tokens=plan.micro_batch_tokens,
                          recompute_layers=plan.recompute_layers)  # gathers the weights for sampling
    else:
        model = wrap_with_lora(model, rank=64, alpha=32, seed=0)
        report["weights_bytes"] = model_bytes(model).frozen
    report["build_s"] = time.perf_counter() - started

    generator = torch.Generator().manual_seed(1)
    if args.decode_rows:
        report["decode_ms_per_step"] = decode_ms_per_step(
            model, config, rows=args.decode_rows, prompt_tokens=args.decode_window // 2,
            new_tokens=args.decode_window // 2, device=args.device, generator=generator)
        save()

    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=config.vocab_size,
                              max_context=config.max_position_embeddings, max_batch_rows=256)
    prompts = [torch.randint(3, config.vocab_size, (args.prompt,), generator=generator).tolist()
               for _ in range(args.groups)]
    request = GenerationRequest(max_tokens=args.new, filters=SamplingFilters(0.6), stop=(), seed=0)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _sync(args.device)
    report["step_started_at"] = time.time()  # for a run stopped mid-step: how long the step had run
    save()
    started = time.perf_counter()
    completions = engine.sample_jobs([SampleJob(p, args.samples, request) for p in prompts])
    _sync(args.device)
    report["sample_s"] = time.perf_counter() - started
    step_started = started
    report["prefill_s"], report["decode_steps"] = engine.prefill_seconds, engine.decode_steps
    report["sampling_peak_bytes"] = _peak(args.device)
    save()

    data = []
    for prompt, group in zip(prompts, completions, strict=True):
        for completion in group:
            tokens = prompt + completion.tokens
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion.tokens)
            advantages = torch.randn(len(weights), generator=generator) * torch.tensor(weights)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                "logprobs": types.TensorData.from_torch(torch.tensor([0.0] * (len(prompt) - 1) + completion.logprobs)),
                "advantages": types.TensorData.from_torch(advantages)}))
    if not full:
        trainer = Trainer(model, pad_token_id=0, vocab_size=config.vocab_size,
                          micro_batch_tokens=plan.micro_batch_tokens, recompute_layers=plan.recompute_layers)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = trainer.forward_backward(data, "importance_sampling")
    _sync(args.device)
    report["forward_backward_s"] = time.perf_counter() - started
    started = time.perf_counter()
    trainer.optim_step(types.AdamParams(learning_rate=1e-6))
    _sync(args.device)
    report["optim_s"] = time.perf_counter() - started
    report["step_s"] = time.perf_counter() - step_started
    report["training_peak_bytes"] = _peak(args.device)
    tokens = int(result.metrics["num_tokens:sum"])
    report["trained_tokens"], report["micro_batches"] = tokens, int(result.metrics["micro_batches:sum"])
    report["tokens_per_s"] = tokens / report["forward_backward_s"]
    flops = (full_training_flops(product_params, tokens, plan.recompute_layers) if full
             else lora_training_flops(product_params, tokens))  # matrix-product weights, lm_head included
    report["mfu"] = flops / report["forward_backward_s"] / H100_BF16_FLOPS
    save()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = measure(args, out)
    print(json.dumps(report, indent=1))
    return judge(report, out)


if __name__ == "__main__":
    sys.exit(main())
