"""oneDNN products with frozen weights (engines/products.py): the same numbers as F.linear to fp32 rounding,
gradients to the input only, and used exactly where the decoder's numerics say."""

from __future__ import annotations

import pytest
import torch

from rlrunbook.backend.settings import LocalSettings
from rlrunbook.engines.decoder import Decoder, Numerics
from rlrunbook.engines.products import frozen_linear, onednn_usable
from rlrunbook.errors import ConfigError

pytestmark = pytest.mark.skipif(not onednn_usable(), reason="this torch build has no usable oneDNN fp32 linear")

UNIT_ROUNDOFF = 2.0 ** -24  # float32


def _rounding_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on an fp32 product's error against exact arithmetic: n * u * (|a| @ |b|) for n-term sums."""
    n = a.shape[-1]
    return n * UNIT_ROUNDOFF * (a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("rows,inputs,outputs,bias", [(1, 96, 40, False), (16, 576, 192, True),
                                                      (37, 257, 1031, False), (300, 64, 64, True)])
def test_forward_and_input_gradient_are_the_product_to_fp32_rounding(rows, inputs, outputs, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs, generator=generator, requires_grad=True)
    weight = torch.randn(outputs, inputs, generator=generator)
    b = torch.randn(outputs, generator=generator) if bias else None
    grad_out = torch.randn(rows, outputs, generator=generator)

    y = frozen_linear(x, weight, b)
    (grad_x,) = torch.autograd.grad(y, x, grad_out)

    exact = x.detach().double() @ weight.double().T + (0 if b is None else b.double())
    assert (y.double() - exact).abs().le(_rounding_bound(x.detach(), weight.T) + 1e-6).all()
    exact_grad = grad_out.double() @ weight.double()
    assert (grad_x.double() - exact_grad).abs().le(_rounding_bound(grad_out, weight)).all()
    # and with no gradient wanted, the same forward values without autograd's bookkeeping
    with torch.no_grad():
        assert torch.equal(frozen_linear(x, weight, b), y.detach())


def test_a_trained_weight_is_refused_and_empty_inputs_work():
    weight = torch.randn(8, 4, requires_grad=True)
    with pytest.raises(ValueError, match="use F.linear for trained ones"):
        frozen_linear(torch.randn(3, 4), weight)
    with torch.no_grad():  # no gradient can flow: allowed
        assert frozen_linear(torch.randn(3, 4), weight).shape == (3, 8)
    assert frozen_linear(torch.randn(0, 4), weight.detach()).shape == (0, 8)


@pytest.mark.parametrize("numerics,dtype,expected", [
    (Numerics("invariant"), torch.float32, True),
    (Numerics("invariant", "mkl"), torch.float32, False),
    (Numerics("native"), torch.float32, False),  # transformers' own products: the reference
    (Numerics("exact"), torch.float32, False),  # float64 products
    (Numerics("invariant"), torch.bfloat16, False),
])
def test_the_decoder_uses_onednn_only_for_fp32_invariant_numerics(tiny_folder, numerics, dtype, expected):
    from rlrunbook.models import load_causal_lm

    model = load_causal_lm(tiny_folder, dtype=dtype, device="cpu")
    assert Decoder(model, numerics).onednn_products is expected


def test_settings_choose_the_products_and_refuse_unknown_ones():
    assert LocalSettings.from_env({"TINKER_LOCAL_DEVICE": "cpu"}).decoder_numerics() == Numerics("invariant", "onednn")
    chosen = LocalSettings.from_env({"TINKER_LOCAL_DEVICE": "cpu", "TINKER_LOCAL_CPU_PRODUCTS": "MKL"})
    assert chosen.decoder_numerics() == Numerics("invariant", "mkl")
    with pytest.raises(ConfigError, match="TINKER_LOCAL_CPU_PRODUCTS"):
        LocalSettings.from_env({"TINKER_LOCAL_CPU_PRODUCTS": "openblas"})
    with pytest.raises(ConfigError, match="cpu_products"):
        Numerics("invariant", "blis")


def test_sampler_and_trainer_agree_with_either_library(tiny_folder):
    """The decode path (16-row steps) and the training path (one long pass) on the same tokens, fp32."""
    from rlrunbook.engines.base import GenerationRequest
    from rlrunbook.engines.filters import SamplingFilters
    from rlrunbook.engines.hf import HFSamplingEngine
    from rlrunbook.engines.shared_prefix import SharedPrefixScorer
    from rlrunbook.models import load_causal_lm

    model = load_causal_lm(tiny_folder, dtype=torch.float32, device="cpu")
    prompt = [1, 285, 201, 279, 261, 223, 40, 41]
    for products in ("onednn", "mkl"):
        numerics = Numerics("invariant", products)
        engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=model.config.vocab_size, numerics=numerics)
        (samples,) = engine.sample([prompt], 4, GenerationRequest(max_tokens=12, filters=SamplingFilters(1.0),
                                                                   stop=(), seed=3))
        scorer = SharedPrefixScorer(Decoder(model, numerics))
        with torch.no_grad():
            sequences = [prompt + list(sample.tokens) for sample in samples]
            run = scorer.run([seq[:-1] for seq in sequences])
            for i, (seq, sample) in enumerate(zip(sequences, samples, strict=True)):
                scores = scorer.score(run.hidden, torch.tensor(run.flat[i]), torch.tensor(seq[1:])).logprobs
                trainer = scores[len(prompt) - 1:]
                assert len(trainer) == len(sample.logprobs) == 12
                assert (trainer - torch.tensor(sample.logprobs)).abs().max().item() <= 1e-4, products
