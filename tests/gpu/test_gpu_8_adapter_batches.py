"""Runbook: several samplers' adapters in one decode batch on CUDA give each sampler what it gets alone.

Two LoRA snapshots of one model and the base model (adapter off), in bfloat16 under the default (fixed-order)
numerics: :meth:`HFSamplingEngine.sample_adapters` decodes their rows as one batch, each row with its own adapter,
with captured graphs (the rows' slots a graph input) and eagerly. Each sampler's tokens and logprobs must equal,
bit for bit, what it samples alone through an eager engine, and its tokens what it samples alone with graphs.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICE, chat_prompts

from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _snapshot(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    from rlrunbook.backend.lora import clone_adapter

    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    snapshot = clone_adapter(model)
    for name, tensor in snapshot.items():
        noise = torch.randn(tensor.shape, generator=generator, device=DEVICE, dtype=torch.float32)
        tensor.copy_(noise * (0.02 if "lora_B" in name else 0.05))
    return snapshot


def test_samplers_decoded_as_one_batch_get_what_they_get_alone(model_name, record_property):
    from peft import LoraConfig, get_peft_model

    from rlrunbook.engines.hf import AdapterJobs, HFSamplingEngine
    from rlrunbook.models import load_causal_lm, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model_name))
    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(resolve_model(model_name), dtype=torch.bfloat16, device=DEVICE),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    common = {"pad_token_id": int(tokenizer.pad_token_id), "vocab_size": model.config.vocab_size}
    request = GenerationRequest(max_tokens=32, filters=SamplingFilters(1.0), stop=(), seed=11)
    jobs = [SampleJob(list(prompt), 4, request) for prompt in chat_prompts(tokenizer, 3)]
    groups = [AdapterJobs(_snapshot(model, 1), "a", jobs), AdapterJobs(_snapshot(model, 2), "b", jobs),
              AdapterJobs(None, "base", jobs)]

    mixed_engine = HFSamplingEngine(model, **common)
    mixed = mixed_engine.sample_adapters(groups)
    assert mixed_engine.graph_captures > 0, "the mixed batch decoded without graphs"
    mixed_eager = HFSamplingEngine(model, cuda_graphs=False, **common).sample_adapters(groups)
    eager, graphs = HFSamplingEngine(model, cuda_graphs=False, **common), HFSamplingEngine(model, **common)
    for group, together, together_eager in zip(groups, mixed, mixed_eager, strict=True):
        with eager.pinned_weights(group.adapter, group.key):
            alone = eager.sample_jobs(group.jobs, weights_key=group.key)
        with graphs.pinned_weights(group.adapter, group.key):
            captured = graphs.sample_jobs(group.jobs, weights_key=group.key)
        for ws, xs, ys, zs in zip(together_eager, together, alone, captured, strict=True):
            for w, x, y, z in zip(ws, xs, ys, zs, strict=True):
                assert (w.tokens, w.logprobs, w.stop_reason) == (y.tokens, y.logprobs, y.stop_reason)
                assert x.tokens == y.tokens == z.tokens
    assert graphs.graph_captures > 0, "the samplers alone ran without graphs"
    tokens = [[tuple(c.tokens) for job in result for c in job] for result in mixed]
    assert len({tuple(t) for t in tokens}) == len(groups), "the adapters must sample differently"
    record_property("samplers", len(groups))
