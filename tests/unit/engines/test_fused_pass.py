"""The fused pass (engines/fused_pass.py): a pass that records no gradient runs each layer as a few fused calls and
gives the bits of the chain of operations the trainer differentiates.

Models are built from small configs with random weights and random LoRA factors (B non-zero, so every adapter
changes the output): a Llama whose width takes the sequential products (64 <= SMALL_K), a wider Llama, and a
Qwen2 with q/k/v biases, in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.fused_pass import FusedPass
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.engines.layouts import RowCache
from rlrunbook.kernels import coded_weights, fused
from rlrunbook.testing.decode_parity import assert_decode_steps_equal_the_training_pass
from rlrunbook.testing.quantized import q4_1, q8_0

_SHAPES = {
    "llama-64": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                     num_key_value_heads=2)),
    "llama-160": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=160, intermediate_size=272, num_attention_heads=5,
                                                      num_key_value_heads=1)),
    "qwen2-128": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=128, intermediate_size=200, num_attention_heads=4,
                                                      num_key_value_heads=2)),
}


def _model(shape: str, dtype: torch.dtype, layers: int = 2, rank: int = 8) -> torch.nn.Module:
    config_class, model_class, sizes = _SHAPES[shape]
    torch.manual_seed(0)
    config = config_class(vocab_size=320, num_hidden_layers=layers, max_position_embeddings=256,
                          tie_word_embeddings=False, **sizes)
    model = model_class(config).to(dtype).eval()
    model = wrap_with_lora(model, rank=rank, alpha=3 * rank, seed=0)  # scaling 3: not a power of two
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.2)
    return model


def _sample(model: torch.nn.Module, fused: bool, monkeypatch) -> list:
    monkeypatch.setattr(Decoder, "use_fused", fused)
    config = model.get_base_model().config
    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=config.vocab_size, max_context=256)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (length,), generator=generator).tolist() for length in (3, 11, 11, 30)]
    request = GenerationRequest(max_tokens=10, filters=SamplingFilters(0.9, top_p=0.95), stop=(), seed=7)
    return [[(c.tokens, c.logprobs) for c in completions]
            for completions in engine.sample_jobs([SampleJob(p, 2, request) for p in prompts])]


def _layer_by_layer(monkeypatch) -> None:
    """Decode steps through the fused calls made layer by layer, not one call for every layer."""
    monkeypatch.setattr(FusedPass, "layers", lambda self: None)


@pytest.mark.parametrize("calls", ["one-call", "per-layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(_SHAPES))
def test_sampling_through_the_fused_pass_gives_the_chain_bits(shape, dtype, calls, monkeypatch):
    model = _model(shape, dtype)
    if calls == "per-layer":
        _layer_by_layer(monkeypatch)
    fused, chain = _sample(model, True, monkeypatch), _sample(model, False, monkeypatch)
    assert fused == chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_steps_through_the_fused_pass_equal_the_trainers_pass(dtype):
    """The trainer's pass records gradients (the chain); each fused decode step equals it at its token, exactly."""
    model = _model("qwen2-128", dtype)
    decoder = Decoder(model)
    tokens = [1, 285, 201, 279, 261, 223, 40, 41, 300, 12, 99, 7, 100, 18]
    assert_decode_steps_equal_the_training_pass(decoder, tokens, record_grad=True)


_COUNTED = ("aten::", "rlrunbook::")


def _ops_per_decode_step(decoder: Decoder, rows: int = 4) -> int:
    """Top-level aten ops and fixed-order kernels (an op called by another is part of it) of one decode step's
    model pass, counted as scripts/profile_decode_ops.py counts them."""
    cache = RowCache(len(decoder.lm.model.layers), rows, 32, decoder.num_kv_heads, decoder.head_dim, decoder.dtype,
                     torch.device("cpu"))
    cache.lengths[:] = 5
    tokens = torch.arange(3, 3 + rows)
    with torch.no_grad(), decoder.weights_fixed():  # as in a sampling call
        decoder.hidden(tokens, cache.lengths, cache)  # first use: stacks and library built
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.hidden(tokens, cache.lengths, cache)
    count = 0
    for event in prof.events():
        if not event.name.startswith(_COUNTED):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(_COUNTED):
            parent = parent.cpu_parent
        count += parent is None
    return count


def test_a_decode_step_runs_its_layers_in_one_fused_call(monkeypatch):
    """Over a per-row cache, every layer of a model with LoRA on its 7 projections runs in one ``decode_layers`` call,
    beside a few for the embedding, the rotary table and the first norm, however many layers; where that call cannot
    run them, 9 calls per layer (see engines/fused_pass.py); the chain runs about 60 per layer."""
    counts = {}
    for layers in (2, 4):
        decoder = Decoder(_model("llama-160", torch.bfloat16, layers=layers))
        counts[layers] = _ops_per_decode_step(decoder)
    assert counts[2] == counts[4] <= 7, counts
    decoder = Decoder(_model("llama-160", torch.bfloat16, layers=4))
    with monkeypatch.context() as patched:
        _layer_by_layer(patched)
        per_layer = _ops_per_decode_step(decoder)
    monkeypatch.setattr(Decoder, "use_fused", False)
    chain = _ops_per_decode_step(decoder)
    assert counts[4] + 8 * 4 <= per_layer <= 9 * 4 + 6, per_layer
    assert chain >= 40 * 4, chain


@pytest.mark.parametrize("rank", [8, 65], ids=["r8", "r65"])
def test_the_training_pass_adds_each_lora_update_in_one_kernel(rank):
    """With gradients recorded (the trainer's pass) on CPU, each of the 7 projections' LoRA updates is one
    ``lora_added`` call (the sequential product with peft's addition in its epilogue: no ``[tokens, out]`` update
    tensor written and read again); a rank over SMALL_K, whose sum is lanes16, keeps the product then ``add_scaled``.
    The bits are the chain's either way (tests/unit/kernels/test_fused_kernels.py)."""
    from rlrunbook.engines.layouts import TreeLayout
    from rlrunbook.prefix_tree import TokenTrie, plan_forward

    model = _model("llama-64", torch.float32, rank=rank)
    decoder = Decoder(model)
    trie = TokenTrie()
    plan = plan_forward(trie, [[5, 9, 14, 3]])
    layout = TreeLayout(plan.rows, plan.flat_of(), trie.positions, torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        hidden = decoder.hidden(torch.tensor([trie.tokens[n] for n in plan.nodes]),
                                torch.tensor([trie.positions[n] for n in plan.nodes]), layout)
    assert hidden.requires_grad
    calls = {name: sum(e.name == f"rlrunbook::{name}" for e in trace.events()) for name in ("lora_added", "add_scaled")}
    layers = len(model.get_base_model().model.layers)
    assert calls == ({"lora_added": 7 * layers, "add_scaled": 0} if rank <= 64 else
                     {"lora_added": 0, "add_scaled": 7 * layers}), calls


def _quantized_model(tie: bool) -> torch.nn.Module:
    """A Llama whose base weights hold a quantized checkpoint's values (projections Q4_1, embedding and output layer
    Q8_0, as the built-in SmolLM2's GGUF), rows of whole 32-value blocks and over SMALL_K terms, with LoRA."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, num_hidden_layers=2, max_position_embeddings=256, hidden_size=128,
                         intermediate_size=224, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.copy_(q8_0(parameter) if "embed" in name or "lm_head" in name else q4_1(parameter))
    model = wrap_with_lora(model, rank=8, alpha=24, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_sampling_reads_quantized_base_weights_from_their_codes_with_the_same_bits(tie, monkeypatch):
    """Where the base weights have a short exact form (kernels/coded_weights.py), decode steps read it: every
    projection group and the output layer, with the tokens and logprobs of a pass over the float32 weights."""
    model = _quantized_model(tie)
    read = []
    original = coded_weights.gemm_nt_coded
    monkeypatch.setattr("rlrunbook.engines.decoder.gemm_nt_coded",
                        lambda *args: read.append(args[1].kind) or original(*args))
    prepared = []
    original_prepare = fused.LoraLinears.prepare.__func__
    monkeypatch.setattr(fused.LoraLinears, "prepare", classmethod(
        lambda cls, *args, **kwargs: prepared.append(kwargs.get("coded")) or original_prepare(cls, *args, **kwargs)))
    short = _sample(model, True, monkeypatch)
    assert read and set(read) == {"q8"}  # the output layer's product, at every decode step
    assert prepared and all(form is not None and form.kind == "q4" for form in prepared)  # 4 groups a layer
    monkeypatch.setattr(Decoder, "coded_weights", False)
    assert short == _sample(model, True, monkeypatch) == _sample(model, False, monkeypatch)


def test_decode_steps_over_coded_weights_equal_the_trainers_pass():
    decoder = Decoder(_quantized_model(tie=False))
    tokens = [1, 285, 201, 279, 261, 223, 40, 41, 300, 12, 99, 7, 100, 18]
    assert_decode_steps_equal_the_training_pass(decoder, tokens, record_grad=True)
