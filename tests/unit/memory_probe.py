"""Run as a script by test_memory_plan.py: one ``forward_backward`` of a model built from published config values
(random weights, no download), printing the process's measured peak and the plan's prediction as JSON.

    python memory_probe.py LAYERS TOKENS TRAINED RECOMPUTE

Run it with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then returns freed buffers to the OS, so the resident set
follows the tensors (with the allocator settings of scripts/test.sh it keeps them in its heap instead).
"""

from __future__ import annotations

import gc
import json
import sys

import torch
from tinker import types
from transformers import AutoModelForCausalLM

from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.backend.memory import model_bytes, token_cost, with_layers
from rlrunbook.backend.trainer import Trainer
from rlrunbook.models.shapes import model_shape


def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _datum(tokens: list[int], trained: int) -> types.Datum:
    inputs, targets = tokens[:-1], tokens[1:]
    weights = torch.tensor([0.0] * (len(inputs) - trained) + [1.0] * trained)
    return types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.tensor(targets)),
        "logprobs": types.TensorData.from_torch(-0.5 * weights), "advantages": types.TensorData.from_torch(weights)})


def main(layers: int, tokens: int, trained: int, recompute: bool) -> None:
    config = with_layers(model_shape("Qwen/Qwen2.5-Math-1.5B")[0], layers)
    torch.manual_seed(0)
    model = wrap_with_lora(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), rank=64, alpha=32,
                           seed=0)
    trainer = Trainer(model, pad_token_id=0, vocab_size=config.vocab_size, recompute_layers=recompute)
    ids = torch.randint(0, config.vocab_size, (tokens + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    trainer.forward_backward([_datum(ids[:9], 4)], "importance_sampling")  # first pass: stacks, kernels
    model.zero_grad(set_to_none=True)
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM: the peak from here on
        handle.write("5")
    trainer.forward_backward([_datum(ids, trained)], "importance_sampling")
    measured = _status("VmHWM") - base
    cost = token_cost(config, torch.float32, 64, "invariant", recompute_layers=recompute)
    planned = cost.bytes(tokens) + model_bytes(model).adapter  # and the adapter's gradient, made in backward
    print(json.dumps({"measured": measured, "planned": planned}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
