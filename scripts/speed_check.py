"""The speed targets' measurements (``gpu-check.sh --part speed``): one subcommand per step, each writing
``OUT/speed-NAME.json`` that ``scripts/gpu_report.py`` turns into the table of targets.

    python scripts/speed_check.py decode-smollm2 --out DIR            # the target's shape, on cuda
    python scripts/speed_check.py decode-smollm2 --out DIR --size tiny  # a toy shape on CPU: the same code path

Steps (``--size gpu``, the default; ``SIZES`` holds both sizes):

- ``decode-smollm2``: ms per decode step of the in-process engine, SmolLM2-135M, 16 rows x 64 new tokens after
  32-token prompts (``scale_check.decode_ms_per_step``: a warm-up call, then the median of 3 calls of (wall time -
  prefill) / decode steps).
- ``decode-1.5b``: the same at Qwen2.5-Math-1.5B's published config with random weights, 64 rows x 256 new tokens
  after 300-token prompts.
- ``mfu``: ``forward_backward`` of 16 distinct rows of 1,024 + 1,536 tokens on that model with LoRA r64 (the
  ``h100-rlvr`` preset's), in the micro-batches the preset's memory plan gives; MFU = ``lora_training_flops``
  (4 x frozen product parameters x tokens; every token distinct, so none is counted twice) / seconds / the card's
  dense bf16 peak (``PEAK_BF16``, by the name the device reports).
- ``debate``: the runbook's mini debate (``MINI_DEBATE``: the ``debate`` part's run, 4 steps instead of 10); the
  median ``time/step_s`` of the steps after the first (which captures graphs).
- ``peer``: ``tests/benchmarks/test_bench_peer.py`` (rlrunbook's step against TRL's ``GRPOTrainer`` with its own
  generation, steps interleaved in one process) on a folder of the 1.5B config with random weights and a tokenizer
  covering its vocabulary (``save_random_model``), 16 prompts x 4 samples x 256 tokens, 2 timed steps. Without TRL
  it says so and, at ``--size gpu``, fails.
- ``clients``: ``tests/benchmarks/test_bench_adapter_batches.py``: 4 LoRA training clients of SmolLM2-135M, each
  sampler asking 16 samples x 64 new tokens at once (their rows decoded as one batch, each with its own adapter),
  against one client alone: the ratio of tokens/s (also against the same requests one client after another).
- ``rlvr``: ``scripts/scale_check.py`` without its decode benchmark: one whole ``h100-rlvr`` step, its phases and
  peaks against the plan; arguments after ``--`` go to it (``--device-memory 80GiB``). Stopped by the part's
  budget (SIGINT), it records how long the step had run.

Every JSON names its size and shape and the device (the card's name and memory as the device reports them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN = "Qwen/Qwen2.5-Math-1.5B"
# Dense bf16 tensor-core peaks (NVIDIA's datasheets), by a name the device reports; the first match counts.
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
DEFAULT_PEAK = ("an H100 SXM's", 989e12)
MINI_DEBATE = ["--mode", "debate", "--env", "summary", "--dataset", "cnn_dailymail", "--reward-fn", "compression",
               "--mock-judge", "--debate-train", "rs_grpo", "--debate-grpo-reward", "task", "--name", "mini_debate_speed"]
SIZES: dict[str, dict[str, dict]] = {
    "decode-smollm2": {"gpu": {"model": "smollm2-135m", "rows": 16, "new": 64, "prompt": 32, "device": "cuda"},
                       "tiny": {"model": "tiny", "rows": 2, "new": 4, "prompt": 8, "device": "cpu"}},
    "decode-1.5b": {"gpu": {"model": QWEN, "rows": 64, "new": 256, "prompt": 300, "device": "cuda"},
                    "tiny": {"model": "tiny", "rows": 2, "new": 4, "prompt": 8, "device": "cpu"}},
    "mfu": {"gpu": {"model": QWEN, "rows": 16, "prompt": 1024, "completion": 1536, "device": "cuda"},
            "tiny": {"model": "tiny", "rows": 2, "prompt": 16, "completion": 8, "device": "cpu"}},
    "debate": {"gpu": {"args": [*MINI_DEBATE, "-n", "64", "--num-groups", "4", "-s", "4"], "device": "cuda"},
               "tiny": {"args": [*MINI_DEBATE, "-n", "8", "--num-groups", "2", "-s", "2", "--max-tokens", "8",
                                  "--model", "tiny", "--backend-device", "cpu"], "device": "cpu"}},
    "peer": {"gpu": {"model": QWEN, "prompts": 16, "samples": 4, "tokens": 256, "steps": 2, "device": "cuda"},
             "tiny": {"model": "tiny", "prompts": 2, "samples": 2, "tokens": 4, "steps": 1, "device": "cpu"}},
    "clients": {"gpu": {"model": "smollm2-135m", "shape": "4x16x64", "device": "cuda"},
                "tiny": {"model": "tiny", "shape": "2x2x4", "device": "cpu"}},
    "rlvr": {"gpu": {"args": []},
             "tiny": {"args": ["--device", "cpu", "--model", "tiny", "--groups", "2", "--samples", "2",
                                "--prompt", "16", "--new", "4"]}},
}


def device_facts(device: str) -> dict:
    """The device as it reports itself: name and memory of a CUDA card, or the CPU."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {"device": device, "gpu": None, "gpu_memory_gib": None}
    props = torch.cuda.get_device_properties(torch.device(device))
    return {"device": device, "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}


def peak_flops(gpu: str | None) -> tuple[str, float]:
    """(whose peak, FLOP/s): the dense bf16 peak of the card named ``gpu``, else an H100 SXM's (said so)."""
    for name, flops in PEAK_BF16:
        if gpu and name in gpu:
            return f"{name} dense bf16", flops
    return f"{DEFAULT_PEAK[0]} dense bf16 (no peak known for {gpu or 'this device'})", DEFAULT_PEAK[1]


def load_model(name: str, device: str):
    """(model, config) in bf16 on CUDA, fp32 on CPU: a published config with random weights made on the device
    (no download), else the model folder ``name`` resolves to."""
    from rlrunbook.models import load_causal_lm, resolve_model
    from rlrunbook.models.shapes import PUBLISHED_CONFIGS, model_shape

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name in PUBLISHED_CONFIGS:
        from transformers import AutoModelForCausalLM

        config = model_shape(name)[0]
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), config
    model = load_causal_lm(resolve_model(name), dtype=dtype, device=device)
    return model, model.config


def _run_benchmark(test_file: str, scratch: Path) -> tuple[int, dict]:
    """``pytest -m benchmark tests/benchmarks/TEST_FILE`` in this process (with the environment the caller set): its
    exit code and its first benchmark's ``extra_info`` (empty where none ran), through a JSON file in ``scratch``."""
    import pytest

    found = scratch / "bench.json"
    code = int(pytest.main(["-m", "benchmark", str(ROOT / "tests" / "benchmarks" / test_file), "-p",
                            "no:cacheprovider", "-q", "-s", "--benchmark-enable", f"--benchmark-json={found}",
                            f"--rootdir={ROOT}"]))
    text = found.read_text() if found.exists() else ""
    benchmarks = json.loads(text).get("benchmarks", []) if text.strip() else []
    return code, benchmarks[0]["extra_info"] if benchmarks else {}


def _write(out: Path, name: str, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"speed-{name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def decode(name: str, out: Path, size: str, _rest: list[str]) -> int:
    from scale_check import decode_ms_per_step

    s = SIZES[name][size]
    model, config = load_model(s["model"], s["device"])
    ms = decode_ms_per_step(model, config, rows=s["rows"], prompt_tokens=s["prompt"], new_tokens=s["new"],
                            device=s["device"], generator=torch.Generator().manual_seed(1), repeats=3)
    _write(out, name, {"size": size, "model": s["model"], "shape": f"{s['rows']} rows x {s['new']} new tokens "
                       f"(prompts of {s['prompt']})", "value": ms, "unit": "ms/step", **device_facts(s["device"])})
    return 0


def mfu(name: str, out: Path, size: str, _rest: list[str]) -> int:
    from scale_check import lora_training_flops
    from tinker import types

    from rlrunbook.backend.lora import wrap_with_lora
    from rlrunbook.backend.memory import model_bytes
    from rlrunbook.backend.trainer import Trainer
    from rlrunbook.rl.setup.config_sources import build_config
    from rlrunbook.rl.setup.memory_plan import plan_memory

    s = SIZES[name][size]
    device, rows, prompt, completion = s["device"], s["rows"], s["prompt"], s["completion"]
    model, config = load_model(s["model"], device)
    model = wrap_with_lora(model, rank=64, alpha=32, seed=0)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    run = build_config(file="h100-rlvr", overrides=[
        f"model={s['model']}", f"num_rollouts={rows}", f"num_groups={rows}", f"max_tokens={completion}",
        f"data.max_prompt_tokens={prompt}", f"backend.device={device}", f"backend.dtype={dtype}"],
        cli={}, strict=False).config
    plan = plan_memory(run)
    generator = torch.Generator().manual_seed(2)
    data = []
    for _ in range(rows):  # distinct prompts: no shared prefix, so every counted token is computed
        tokens = torch.randint(3, config.vocab_size, (prompt + completion,), generator=generator)
        mask = torch.tensor([0.0] * (prompt - 1) + [1.0] * completion)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(tokens[1:]),
            "logprobs": types.TensorData.from_torch(torch.zeros(len(mask))),
            "advantages": types.TensorData.from_torch(torch.randn(len(mask), generator=generator) * mask)}))
    trainer = Trainer(model, pad_token_id=0, vocab_size=config.vocab_size,
                          micro_batch_tokens=plan.micro_batch_tokens, recompute_layers=plan.recompute_layers)
    trainer.forward_backward(data, "importance_sampling")  # warm-up: kernels, allocator
    seconds = []
    for _ in range(2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = trainer.forward_backward(data, "importance_sampling")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    facts = device_facts(device)
    whose, flops = peak_flops(facts["gpu"])
    tokens = int(result.metrics["num_tokens:sum"])
    product_params = model_bytes(model).float64_copy // 8  # the frozen matrix-product weights (lm_head included)
    median = statistics.median(seconds)
    _write(out, name, {"size": size, "model": s["model"], "value": 100 * lora_training_flops(product_params, tokens)
                       / median / flops, "unit": "% MFU",
                       "shape": f"{rows} rows x {prompt + completion} tokens, LoRA r64, "
                       f"{int(result.metrics['micro_batches:sum'])} micro-batch(es)",
                       "forward_backward_s": median, "tokens": tokens, "product_params": product_params,
                       "peak_flops": flops, "peak_of": whose, "recompute_layers": plan.recompute_layers,
                       "formula": "4 x frozen product parameters x tokens / seconds / peak", **facts})
    return 0


def debate(name: str, out: Path, size: str, _rest: list[str]) -> int:
    from rlrunbook import cli

    args, device = SIZES[name][size]["args"], SIZES[name][size]["device"]
    logs = out / "speed-debate-logs"
    code = cli.main(["train", *args, "--log-root", str(logs)])
    runs = sorted(logs.glob("*/train_log.jsonl"))
    steps = [json.loads(line) for line in runs[-1].read_text().splitlines() if line.strip()] if runs else []
    timed = [row["time/step_s"] for row in steps[1:]] or [row["time/step_s"] for row in steps]
    _write(out, name, {"size": size, "shape": " ".join(args[len(MINI_DEBATE):]),
                       "value": statistics.median(timed) if timed else None, "unit": "s/step",
                       "steps": len(steps), "first_step_s": steps[0]["time/step_s"] if steps else None,
                       "exit": code, **device_facts(device)})
    return code


def peer(name: str, out: Path, size: str, _rest: list[str]) -> int:
    from rlrunbook.testing.trl import missing_trl_reason

    s = SIZES[name][size]
    shape = f"{s['prompts']} prompts x {s['samples']} samples x {s['tokens']} tokens, {s['model']}"
    facts = device_facts(s["device"])
    missing = missing_trl_reason()
    if missing is not None:
        print(f"TRL IS NOT INSTALLED HERE: {missing}. The comparison with TRL's GRPOTrainer was not run"
              + (" (a failure at --size gpu)." if size == "gpu" else "."))
        _write(out, name, {"size": size, "shape": shape, "value": None, "missing": missing, **facts})
        return 1 if size == "gpu" else 0

    from rlrunbook.models.shapes import PUBLISHED_CONFIGS, model_shape, save_random_model

    scratch = Path(tempfile.mkdtemp(prefix="speed-peer-"))  # outside OUT: the model folder is not an artifact
    try:
        model = s["model"]
        if model in PUBLISHED_CONFIGS:
            model = str(save_random_model(model_shape(model)[0], scratch / "model", dtype=torch.bfloat16,
                                          device=s["device"]))
        os.environ.update({"RLRUNBOOK_PEER_MODEL": model, "RLRUNBOOK_PEER_SHAPE":
                           f"{s['prompts']}x{s['samples']}x{s['tokens']}", "RLRUNBOOK_PEER_STEPS": str(s["steps"]),
                           "RLRUNBOOK_BENCH_DEVICE": s["device"], "RLRUNBOOK_REQUIRE_TRL": "1"})
        code, info = _run_benchmark("test_bench_peer.py", scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratio = info.get("ratio_rlrunbook_over_trl")
    _write(out, name, {"size": size, "shape": shape, "value": ratio, "unit": "x TRL's s/step", "exit": code,
                       "rlrunbook_s_per_step": info.get("rlrunbook_s_per_step"),
                       "trl_s_per_step": info.get("trl_s_per_step"), "trl_generate_s": info.get("trl_generate_s"),
                       "rlrunbook_sample_s": info.get("rlrunbook_sample_s"), **facts})
    if ratio is not None:
        print(f"rlrunbook {info['rlrunbook_s_per_step']} s/step, TRL GRPOTrainer {info['trl_s_per_step']} s/step: "
              f"ratio {ratio} (target <= 0.25)")
    return code


def clients(name: str, out: Path, size: str, _rest: list[str]) -> int:

    s = SIZES[name][size]
    count, rows, tokens = s["shape"].split("x")
    shape = f"{count} clients x {rows} samples x {tokens} new tokens, {s['model']}, LoRA r32 each"
    scratch = Path(tempfile.mkdtemp(prefix="speed-clients-"))
    try:
        os.environ.update({"RLRUNBOOK_BENCH_MODELS": s["model"], "RLRUNBOOK_BENCH_DEVICE": s["device"],
                           "RLRUNBOOK_CLIENTS_SHAPE": s["shape"]})
        code, info = _run_benchmark("test_bench_adapter_batches.py", scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _write(out, name, {"size": size, "shape": shape, "value": info.get("together_vs_one_client"),
                       "unit": "x one client's tokens/s", "exit": code,
                       **{key: info.get(key) for key in ("tokens_per_s_one_client", "tokens_per_s_together",
                                                         "tokens_per_s_one_after_another")},
                       **device_facts(s["device"])})
    return code


def rlvr(name: str, out: Path, size: str, rest: list[str]) -> int:
    import scale_check

    args = [*SIZES[name][size]["args"], *rest]
    device = args[args.index("--device") + 1] if "--device" in args else "cuda"
    report = {"size": size, "shape": "one step of the h100-rlvr preset" + (f" ({' '.join(args)})" if args else ""),
              "unit": "s", **device_facts(device)}
    _write(out, name, report)
    try:
        scale_check.main(["--out", str(out), "--decode-rows", "0", *args])
    except KeyboardInterrupt:  # the part's budget: record how long the step had run
        figures = json.loads((out / "scale.json").read_text())
        if "step_started_at" in figures:
            report["at_least"] = time.time() - figures["step_started_at"]
        report["stopped"] = True
        _write(out, name, report)
        raise
    report["value"] = json.loads((out / "scale.json").read_text())["step_s"]
    _write(out, name, report)
    return 0


STEPS = {"decode-smollm2": decode, "decode-1.5b": decode, "mfu": mfu, "debate": debate, "peer": peer,
         "clients": clients, "rlvr": rlvr}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=("gpu", "tiny"), default="gpu",
                        help="gpu: the targets' shapes (default); tiny: a toy shape on CPU")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    return STEPS[args.step](args.step, args.out, args.size, rest)


if __name__ == "__main__":
    sys.exit(main())
