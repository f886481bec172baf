"""What ``exact`` numerics rest on, shown on CPU: a row's result depends neither on how many rows share the call nor
on the order its sums are added in.

On CUDA the sampler's decode step (1, 2 or 16 rows) and the trainer's pass (500+ rows) reach different kernels:
PyTorch's reductions lay out their threads by the number of rows, and cuBLAS picks split-K kernels by shape, so one
row's sums are added in different orders. ``exact`` accumulates every product and every RMSNorm's statistics in
float64 and rounds once to the model's dtype: a float64 sum's order changes it by ~1e-16 relative, far below one
rounding step of float32 (6e-8) or bf16 (4e-3), so the rounded result is the same in any order (except in the rare
case where the exact value lies within ~1e-16 of a rounding boundary). The order of a sum is changed here by
permuting the summed dimension, the way a different kernel would; float32 statistics (the ``invariant`` numerics of
a float32 model) are shown to change under it, so the tests can tell the two apart.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlrunbook.engines.decoder import Decoder

# SmolLM2-135M's widths (hidden 576, MLP 1536), one layer, a smaller vocabulary: the shapes of a real model.
CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 1, "num_attention_heads": 9,
          "num_key_value_heads": 3, "vocab_size": 8192, "initializer_range": 0.2}
DECODE_ROWS = (1, 2, 16)
TRAINING_ROWS = (512, 520)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(request.param).eval()
    for param in model.parameters():
        param.requires_grad_(False)  # frozen base weights, as under LoRA
    with torch.no_grad():
        model.model.norm.weight.normal_(1.0, 0.2)
    return model


def _inputs(model, rows: int = max(TRAINING_ROWS)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(rows, CONFIG["hidden_size"], generator=generator) * 3 + 0.5).to(model.dtype)


class _PermutedNorm(torch.nn.Module):
    """An RMSNorm over permuted features (same eps, weight permuted alike)."""

    def __init__(self, norm: torch.nn.Module, perm: torch.Tensor):
        super().__init__()
        self.weight = norm.weight[perm]
        self.variance_epsilon = norm.variance_epsilon


@torch.no_grad()
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call(model):
    decoder = Decoder(model, "exact")
    x = _inputs(model)
    norm, weight = model.model.norm, model.model.layers[0].mlp.up_proj.weight
    pieces = {
        "norm": lambda rows: decoder._norm(norm, rows),
        "product": lambda rows: decoder._product(rows, weight, None),
        "logits": decoder.logits,
    }
    for name, piece in pieces.items():
        reference = piece(x)  # every row in one call: the training pass
        for rows in (*DECODE_ROWS, *TRAINING_ROWS):
            assert torch.equal(piece(x[:rows]), reference[:rows]), f"{name}: {rows} rows"
            assert torch.equal(piece(x[rows - 1:rows]), reference[rows - 1:rows]), f"{name}: row {rows - 1} alone"


@torch.no_grad()
@pytest.mark.parametrize("piece", ["norm", "product"])
def test_exact_results_do_not_depend_on_the_summation_order(model, piece):
    x = _inputs(model)
    perm = torch.randperm(CONFIG["hidden_size"], generator=torch.Generator().manual_seed(2))
    norm, weight = model.model.norm, model.model.layers[0].mlp.up_proj.weight

    def both_orders(decoder):
        if piece == "norm":
            return decoder._norm(norm, x), decoder._norm(_PermutedNorm(norm, perm), x[:, perm])[:, torch.argsort(perm)]
        return decoder._product(x, weight, None), decoder._product(x[:, perm], weight[:, perm].contiguous(), None)

    in_order, reordered = both_orders(Decoder(model, "exact"))
    assert torch.equal(in_order, reordered)
    if model.dtype == torch.float32:  # the same sums in float32 (invariant numerics) do move: the check can fail
        in_order, reordered = both_orders(Decoder(model, "invariant"))
        assert not torch.equal(in_order, reordered)
