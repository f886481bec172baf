"""Quantised base weights are routed, not crashed: refused by the in-process engine, trained by the padded path.

bitsandbytes' ``Linear4bit`` subclasses ``nn.Linear`` and holds its weight as packed uint8 (two 4-bit codes per
byte, shape ``[out * in / 2, 1]``) that only its own ``forward`` dequantises. :class:`PackedLinear` below is the
same arrangement on CPU: an ``nn.Linear`` whose ``weight`` is packed uint8 codes. The in-process engine must refuse
such a model naming the samplers that run it, ``generate`` must sample it, and the trainer must score it with
transformers' forward over padded datums (its own ``forward``), whatever sampler the run uses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.chunk_scores import PaddedScoring
from rlrunbook.engines.decoder import Decoder, quantised_weights, unsupported_reason
from rlrunbook.engines.generate import GenerateEngine
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.errors import ConfigError
from rlrunbook.tokens import build_datum_arrays

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PackedLinear(torch.nn.Linear):
    """A linear layer with 4-bit weights packed two per uint8 (as bitsandbytes' Linear4bit), dequantised in forward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        weight = linear.weight.detach().float()
        low, high = weight.min(), weight.max()
        codes = ((weight - low) / (high - low) * 15).round().to(torch.uint8).flatten()  # [out * in], 0..15
        packed = (codes[0::2] << 4) | codes[1::2]
        self.weight = torch.nn.Parameter(packed[:, None], requires_grad=False)  # [out * in / 2, 1] uint8
        self.register_buffer("low", low)
        self.register_buffer("step", (high - low) / 15)
        self.compute_dtype = linear.weight.dtype
        if linear.bias is not None:
            self.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantised(self) -> torch.Tensor:
        packed = self.weight.flatten()
        codes = torch.stack([packed >> 4, packed & 15], dim=1).flatten()
        return (codes.float() * self.step + self.low).view(self.out_features, self.in_features).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantised().to(x.dtype), self.bias)


def pack_projections(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every attention and MLP projection of ``model`` by a :class:`PackedLinear` (the output layer stays)."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    setattr(parent, name, PackedLinear(getattr(parent, name)))
    return model


@pytest.fixture
def packed_tiny(tiny_folder):
    from rlrunbook.models import load_causal_lm

    return pack_projections(load_causal_lm(tiny_folder, dtype=torch.float32))


@pytest.fixture
def packed_loading(monkeypatch):
    """The local backend's loader returns the tiny model with packed projections (what load_in_4bit gives on CUDA)."""
    from rlrunbook.backend import model_host as host

    real = host.load_causal_lm
    monkeypatch.setattr(host, "load_causal_lm", lambda *args, **kwargs: pack_projections(real(*args, **kwargs)))


def test_packed_linear_is_what_the_decoder_used_to_crash_on(packed_tiny):
    """The stand-in has the property that matters: an nn.Linear whose weight F.linear cannot use."""
    layer = packed_tiny.model.layers[0].self_attn.q_proj
    assert isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.uint8
    x = torch.randn(2, layer.in_features)
    assert layer(x).shape == (2, layer.out_features)
    with pytest.raises(RuntimeError):
        F.linear(x, layer.weight, layer.bias)


def test_the_decoder_refuses_quantised_weights_naming_the_samplers_that_run_them(packed_tiny):
    assert "model.layers.0.self_attn.q_proj (PackedLinear, uint8 weight)" in quantised_weights(packed_tiny)
    assert "quantised" in unsupported_reason(packed_tiny)
    for build in (lambda: Decoder(packed_tiny), lambda: HFSamplingEngine(packed_tiny, pad_token_id=0, vocab_size=512)):
        with pytest.raises(ConfigError, match="quantised") as refused:
            build()
        assert "TINKER_LOCAL_SAMPLER=generate" in str(refused.value) and "vllm" in str(refused.value)


def test_float_models_are_not_taken_for_quantised(tiny_folder):
    from rlrunbook.models import load_causal_lm

    for dtype in (torch.float32, torch.bfloat16):
        model = load_causal_lm(tiny_folder, dtype=dtype)
        assert quantised_weights(model) is None and unsupported_reason(model) is None


def _datum(prompt: list[int], completion: list[int], advantage: float) -> types.Datum:
    arrays = build_datum_arrays(prompt, completion, [0.0] * len(completion), [advantage] * len(completion))
    return types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                       loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                       "advantages": arrays.advantages})


def test_generate_samples_and_the_padded_path_trains_a_quantised_model(packed_loading, tmp_path):
    settings = LocalSettings(device="cpu", dtype=torch.float32, sampler="generate", storage_dir=tmp_path)
    prompt = [5, 17, 42, 9, 11]
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        assert isinstance(training._trainer.scoring, PaddedScoring)  # not the shared-prefix decoder pass
        sampler = training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
        sequences = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
        packed = {n: p.detach().clone() for n, p in training._host.model.named_parameters() if p.dtype == torch.uint8}
        assert packed, "the projections are packed"
        out = training.forward_backward([_datum(prompt, list(s.tokens), a) for s, a in
                                         zip(sequences, [1.0, -1.0, 0.5, -0.5], strict=True)],
                                        "importance_sampling").result()
        assert all(torch.isfinite(torch.tensor(d["logprobs"].data)).all() for d in out.loss_fn_outputs)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = dict(training._host.model.named_parameters())
        assert all(torch.equal(after[n], before) for n, before in packed.items()), "the base weights never change"


def test_the_in_process_sampler_is_refused_at_load_naming_the_fix(packed_loading, tmp_path):
    settings = LocalSettings(device="cpu", dtype=torch.float32, sampler="hf", storage_dir=tmp_path)
    with LocalServiceClient(settings) as service, pytest.raises(ConfigError, match="TINKER_LOCAL_SAMPLER=generate"):
        service.create_lora_training_client("tiny", rank=4, seed=0)


def test_with_the_vllm_sampler_the_host_keeps_no_decoder_for_a_quantised_model(packed_loading):
    """Under vllm the in-process engine only validates, draws seeds and scores prompts: generate's engine does."""
    from rlrunbook.backend.model_host import load_host

    host = load_host("tiny", LocalSettings(device="cpu", dtype=torch.float32, sampler="vllm"))
    assert isinstance(host.engine, GenerateEngine)
