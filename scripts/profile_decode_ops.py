"""Kernels per decode step: the ops one decode step of the in-process engine runs, counted with torch.profiler,
split into the model step (what a CUDA graph captures and replays) and the rest (the draw, the filters and the
bookkeeping, launched one by one every step).

    python scripts/profile_decode_ops.py                          # SmolLM2-135M, bf16, 16 rows x 64 tokens, CPU
    python scripts/profile_decode_ops.py --model tiny --rows 64 --tokens 256

Counted on any device: the same ops run on CPU and on CUDA. Top-level aten ops and the fixed-order kernels of the
default numerics (``rlrunbook::*``) are counted (an op called by another op is part of it); view-only ops (view,
slice, unsqueeze, transpose, ...) launch no kernel.
"""

from __future__ import annotations

import argparse
import bisect
import collections
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.models.loading import load_causal_lm
from rlrunbook.models.registry import resolve_model

MODEL_STEP = "decode/model_step"


_COUNTED = ("aten::", "rlrunbook::")


def _top_level(events) -> list:
    """The aten ops and fixed-order kernels of ``events`` that no other counted op called."""
    found = []
    for event in events:
        if not event.name.startswith(_COUNTED):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(_COUNTED):
            parent = parent.cpu_parent
        if parent is None:
            found.append(event)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--top", type=int, default=20, help="ops listed in each part")
    args = parser.parse_args()

    model = load_causal_lm(resolve_model(args.model), getattr(torch, args.dtype))
    model = wrap_with_lora(model, rank=16, alpha=32, seed=0)
    config = model.get_base_model().config
    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=config.vocab_size,
                              max_context=config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (args.prompt,), generator=generator).tolist()
               for _ in range(args.rows)]
    request = GenerationRequest(max_tokens=args.tokens, filters=SamplingFilters(1.0), stop=(), seed=1)
    jobs = [SampleJob(p, 1, request) for p in prompts]
    engine.sample_jobs(jobs)  # warm-up: caches built

    step = HFSamplingEngine._step

    def marked(self, *a, **k):
        with record_function(MODEL_STEP):
            return step(self, *a, **k)

    with mock.patch.object(HFSamplingEngine, "_step", marked), profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.sample_jobs(jobs)
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == MODEL_STEP)
    starts = [start for start, _ in spans]

    def in_model_step(t: int) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and spans[i][0] <= t <= spans[i][1]

    inside, outside = collections.Counter(), collections.Counter()
    for event in _top_level(events):
        (inside if in_model_step(event.time_range.start) else outside)[event.name] += 1
    steps, layers = len(spans), config.num_hidden_layers
    print(f"{args.model} {args.dtype}, {args.rows} rows x {args.tokens} tokens: {steps} decode steps")
    print(f"top-level ops per decode step: {sum(inside.values()) / steps:.0f} in the model step "
          f"({sum(inside.values()) / steps / layers:.1f} per layer of {layers}), "
          f"{sum(outside.values()) / steps:.0f} outside it (prefill included, spread over the steps)")
    print("in the model step, per layer:")
    for name, count in inside.most_common(args.top):
        print(f"  {count / steps / layers:7.2f}  {name}")
    print("outside it, per step:")
    for name, count in outside.most_common(args.top):
        print(f"  {count / steps:7.1f}  {name}")


if __name__ == "__main__":
    main()
