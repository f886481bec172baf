"""Kernels per decode step: the ops one decode step of the in-process engine runs, counted with torch.profiler,
split into the model step (what a CUDA graph captures and replays), the call's setup (prefill and the decode
cache's fill, once per call) and the rest (the draw, the filters and the bookkeeping, launched one by one every
step), with the host syncs of the decode loop.

    python scripts/profile_decode_ops.py                          # SmolLM2-135M, bf16, 16 rows x 64 tokens, CPU
    python scripts/profile_decode_ops.py --model tiny --rows 64 --tokens 256
    python scripts/profile_decode_ops.py --eager-draw             # the draw by the eager reference path
    python scripts/profile_decode_ops.py --triton --model tiny    # the CUDA path's ops, counted on this CPU

Counted on the device at hand. On CPU the model step runs through the fused C pass; ``--triton`` counts what CUDA
runs instead (the Triton kernels, interpreted on a CPU: slow, hence small models and few tokens). What counts as an
op and as a host sync: :mod:`rlrunbook.testing.decode_ops`.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if "--triton" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels on this CPU: set before triton loads

from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import SYNC_EVERY, HFSamplingEngine
from rlrunbook.models.loading import load_causal_lm
from rlrunbook.models.registry import resolve_model
from rlrunbook.testing.decode_ops import count_decode_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--top", type=int, default=20, help="ops listed in each part")
    parser.add_argument("--eager-draw", action="store_true", help="draw by the eager reference path")
    parser.add_argument("--sync-every", type=int, default=SYNC_EVERY, help="decode steps between reads of tokens")
    parser.add_argument("--triton", action="store_true",
                        help="the fixed-order kernels in Triton, as on CUDA (interpreted where there is no GPU)")
    args = parser.parse_args()
    if args.triton:
        from rlrunbook.kernels import gpu, ops

        ops._backend = lambda device: gpu  # CPU tensors to the Triton kernels; the fused C pass then stands aside

    model = load_causal_lm(resolve_model(args.model), getattr(torch, args.dtype))
    model = wrap_with_lora(model, rank=16, alpha=32, seed=0)
    config = model.get_base_model().config
    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=config.vocab_size,
                              max_context=config.max_position_embeddings, fused_draw=not args.eager_draw,
                              sync_every=args.sync_every)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (args.prompt,), generator=generator).tolist()
               for _ in range(args.rows)]
    request = GenerationRequest(max_tokens=args.tokens, filters=SamplingFilters(1.0), stop=(), seed=1)
    jobs = [SampleJob(p, 1, request) for p in prompts]
    engine.sample_jobs(jobs)  # warm-up: caches built
    counts = count_decode_ops(engine, jobs)
    steps, layers = counts.steps, config.num_hidden_layers
    print(f"{args.model} {args.dtype}, {args.rows} rows x {args.tokens} tokens: {steps} decode steps"
          f"{' (eager draw)' if args.eager_draw else ''}{', Triton kernels' if args.triton else ''}")
    print(f"top-level ops per decode step: {counts.model_step_per_step:.0f} in the model step "
          f"({counts.model_step_per_step / layers:.1f} per layer of {layers}), "
          f"{counts.rest_per_step:.0f} outside it (the draw and bookkeeping; "
          f"{counts.rest_per_step + counts.setup_per_step:.0f} with the call's setup spread over the steps)")
    print(f"outside the model step: {counts.rest_per_step:.2f} ops per step; the call's setup (prefill, cache fill): "
          f"{sum(counts.setup.values())} ops, {counts.setup_per_step:.1f} per step")
    print(f"host syncs outside the model step: {counts.host_syncs} in {steps} steps "
          f"({counts.host_reads} reads of drawn tokens); in the model step: {counts.model_step_syncs}")
    print("in the model step, per layer:")
    for name, count in counts.model_step.most_common(args.top):
        print(f"  {count / steps / layers:7.2f}  {name}")
    print("outside it, per step:")
    for name, count in counts.rest.most_common(args.top):
        print(f"  {count / steps:7.2f}  {name}")


if __name__ == "__main__":
    main()
