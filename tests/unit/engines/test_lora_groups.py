"""LoRA updates of a projection group computed with stacked factors inside Decoder.weights_fixed()
(engines/lora_groups.py, under native numerics of a float32 CPU model: invariant numerics compute every
update with the fixed-order kernels instead): the same numbers as peft's module-by-module updates to fp32 rounding (the
update is added into the base output by one fused product, so the last bits may differ), the same
sampled tokens, built once per block, and never used where they would be wrong (outside the block,
with gradients, adapters disabled).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.layouts import RowCache
from rlrunbook.engines.lora_groups import group_factors

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(tiny_folder, rank=4, alpha=8):
    from rlrunbook.models import load_causal_lm

    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(tiny_folder, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS))
    for name, param in model.named_parameters():  # B starts at zero: move it so the adapters count
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    return model


def _decode_logits(decoder: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a two-token pass per row through a fresh RowCache (prefill one token, decode one)."""
    config = decoder.lm.config
    cache = RowCache(config.num_hidden_layers, ids.shape[0], 8, decoder.num_kv_heads, decoder.head_dim,
                     torch.float32, torch.device("cpu"))
    decoder.hidden(ids[:, 0], cache.lengths.clone(), cache)
    cache.lengths += 1
    return decoder.logits(decoder.hidden(ids[:, 1], cache.lengths.clone(), cache))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alpha", [8, 3], ids=["scaling-2", "scaling-0.75"])
def test_grouped_updates_equal_peft_updates(tiny_folder, alpha):
    model = _lora_model(tiny_folder, alpha=alpha)
    decoder = Decoder(model, "native")
    ids = torch.tensor([[5, 17], [300, 2], [41, 41]])
    with torch.no_grad():
        plain = _decode_logits(decoder, ids)
        with decoder.weights_fixed():
            grouped = _decode_logits(decoder, ids)
            assert any(plan is not None and plan.factors is not None for _, plan in decoder._plans.values())
    assert _close(grouped, plain), (grouped - plain).abs().max()


def test_factors_are_built_once_per_block_and_rebuilt_for_new_weights(tiny_folder):
    model = _lora_model(tiny_folder)
    decoder = Decoder(model, "native")
    ids = torch.tensor([[5, 17], [300, 2]])
    attn = model.get_base_model().model.layers[0].self_attn
    a_q = attn.q_proj.lora_A["default"].weight
    with torch.no_grad():
        with decoder.weights_fixed():
            before = _decode_logits(decoder, ids)
            factors = decoder._plans[(tuple(map(id, (attn.q_proj, attn.k_proj, attn.v_proj))), decoder._factor_source())][1].factors
            _decode_logits(decoder, ids)
            assert decoder._plans[(tuple(map(id, (attn.q_proj, attn.k_proj, attn.v_proj))), decoder._factor_source())][1].factors is factors
        a_q.add_(1.0)  # an optimizer step between sampling calls
        plain = _decode_logits(decoder, ids)
        with decoder.weights_fixed():
            after = _decode_logits(decoder, ids)
    assert not _close(after, before), "the new adapter weights must be used"
    assert _close(after, plain)


def test_no_factors_outside_the_block_with_gradients_or_without_adapters(tiny_folder):
    model = _lora_model(tiny_folder)
    decoder = Decoder(model, "native")
    attn = model.get_base_model().model.layers[0].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(3, model.config.hidden_size, requires_grad=True)
    assert decoder._group_plan(group).factors is None  # outside weights_fixed: module by module
    with decoder.weights_fixed():
        q, k, v = decoder.linears(group, x)  # with gradients: peft's path, gradients reach A and B
        (q.sum() + k.sum() + v.sum()).backward()
        assert attn.q_proj.lora_A["default"].weight.grad is not None
        assert attn.v_proj.lora_B["default"].weight.grad is not None
    with model.disable_adapter():
        assert group_factors(group) is None
        with torch.no_grad(), decoder.weights_fixed():
            base = decoder.linears(group, x)
            assert all(_close(b, m.base_layer(x)) for b, m in zip(base, group, strict=True))
    assert group_factors(group) is not None
    assert group_factors([attn.q_proj.base_layer]) is None  # a plain Linear has no adapter


def test_the_engine_samples_the_same_with_grouped_updates(tiny_folder):
    """The engine's sampling calls run inside weights_fixed: every sampled token identical to module by
    module, every logprob within 1e-5."""
    from rlrunbook.engines.base import GenerationRequest
    from rlrunbook.engines.filters import SamplingFilters
    from rlrunbook.engines.hf import HFSamplingEngine

    model = _lora_model(tiny_folder)
    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=model.config.vocab_size, numerics="native")
    assert engine.decoder.grouped_adapters
    request = GenerationRequest(max_tokens=12, filters=SamplingFilters(1.0), stop=(), seed=3)
    grouped = engine.sample([[5, 17, 300], [41, 2]], 3, request)
    engine.decoder.grouped_adapters = False
    plain = engine.sample([[5, 17, 300], [41, 2]], 3, request)
    for mine, theirs in zip(grouped, plain, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.tokens == b.tokens
            assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
