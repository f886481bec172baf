"""Runbook §7, CUDA graphs of the decode step: the same samples as eager decoding, across weight updates.

In fp32 with fixed seeds, decoding with captured graphs (the default on CUDA) must sample exactly the
tokens of eager decoding (``cuda_graphs=False``) with every logprob within 1e-5, and a graph captured
before an optimizer-like in-place change of the LoRA weights must compute with the new weights when
replayed (the graphs read the parameters' storage, which optimizer steps update in place).
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICE, chat_prompts

from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(model_name: str):
    from peft import LoraConfig, get_peft_model

    from rlrunbook.models import load_causal_lm, resolve_model

    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(resolve_model(model_name), dtype=torch.float32, device=DEVICE),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():  # B starts at zero: move it so the adapters count
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


def _same(a, b) -> float:
    """Assert identical tokens and stop reasons; return the largest logprob difference."""
    worst = 0.0
    for xs, ys in zip(a, b, strict=True):
        for x, y in zip(xs, ys, strict=True):
            assert x.tokens == y.tokens and x.stop_reason == y.stop_reason
            worst = max([worst, *(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True))])
    return worst


def test_graph_decoding_equals_eager_decoding_across_weight_updates(model_name, record_property):
    from rlrunbook.engines.hf import HFSamplingEngine
    from rlrunbook.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model_name))
    model = _lora_model(model_name)
    common = {"pad_token_id": int(tokenizer.pad_token_id), "vocab_size": model.config.vocab_size}
    graphs = HFSamplingEngine(model, cuda_graphs=True, **common)
    eager = HFSamplingEngine(model, cuda_graphs=False, **common)
    prompts = chat_prompts(tokenizer, 4)
    request = GenerationRequest(max_tokens=32, filters=SamplingFilters(1.0), stop=(), seed=11)

    first = graphs.sample(prompts, 4, request)
    worst = _same(first, eager.sample(prompts, 4, request))
    captures = graphs.graph_captures
    assert captures > 0, "the CUDA-graph path did not run"

    with torch.no_grad():  # an optimizer step: every adapter weight changed in place
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param), alpha=0.05)
    second = graphs.sample(prompts, 4, request)
    worst = max(worst, _same(second, eager.sample(prompts, 4, request)))
    assert graphs.graph_captures == captures, "the graphs captured before the update are replayed"
    assert any(x.tokens != y.tokens for xs, ys in zip(first, second, strict=True) for x, y in zip(xs, ys)), \
        "the replayed graphs must compute with the updated weights"
    record_property("max_abs_logprob_diff", worst)
    record_property("captures", captures)
    assert worst <= 1e-5


def test_bf16_lora_decode_steps_equal_the_training_pass_through_the_layer_kernels(model_name, record_property):
    """The layer kernels on the GPU (rlrunbook.kernels.gpu_layer, ops.lora_added): a bf16 model with LoRA r8 on every
    projection (float32 factors, B moved off zero) decodes token by token over its cache, and each step's final
    hidden state equals the training pass's (recording gradients) at that token, bit for bit; the decode layer runs
    one norm, rotation, activation and LoRA addition kernel each (``tests/unit/kernels`` checks the same
    interpreted)."""
    from collections import Counter

    from torch.profiler import profile

    from rlrunbook.backend.lora import wrap_with_lora
    from rlrunbook.engines.decoder import Decoder
    from rlrunbook.models import load_causal_lm, resolve_model
    from rlrunbook.testing.decode_ops import _top_level
    from rlrunbook.testing.decode_parity import assert_decode_steps_equal_the_training_pass

    model = wrap_with_lora(load_causal_lm(resolve_model(model_name), dtype=torch.bfloat16, device=DEVICE), rank=8,
                           alpha=16, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    decoder = Decoder(model, "invariant")
    layers = len(model.get_base_model().model.layers)
    tokens = list(range(5, 45))
    cache = assert_decode_steps_equal_the_training_pass(decoder, tokens, record_grad=True)
    cache.lengths[:] = len(tokens)
    with torch.no_grad(), decoder.weights_fixed(), profile() as trace:
        decoder.hidden(torch.tensor([5, 6], device=DEVICE), cache.lengths.clone(), cache)
    top = Counter(e.name for e in _top_level(trace.events()))
    record_property("decode_ops_per_layer", sum(top.values()) / layers)
    assert top["rlrunbook::rotary"] == 2 * layers and top["rlrunbook::silu_mul"] == layers
    assert top["rlrunbook::lora_added"] >= 7 * layers and top["rlrunbook::rms_norm"] == 2 * layers + 1
