"""Coded weights (kernels/coded_weights.py): a float32 weight's short exact form gives back every value bit for bit,
and a product over it has the bits of gemm_nt over the float32 weight."""

from __future__ import annotations

import pytest
import torch

from rlrunbook.kernels import coded_weights, cpu
from rlrunbook.kernels.coded_weights import code_weight, gemm_nt_coded
from rlrunbook.testing.quantized import q4_1, q8_0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _weight(form: str, rows: int = 200, columns: int = 576, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=generator) * 0.05 + torch.rand(rows, 1, generator=generator) * 0.02
    return {"q4": q4_1, "q8": q8_0, "bf16": lambda w: w.bfloat16().float()}[form](x)


def test_a_q4_block_keeps_its_codes_in_half_bytes_and_its_scale_and_offset():
    """Hand-made: codes 0..15 then 15..0 with scale 0.5 and offset -1; block byte j holds value j's code in its low
    half and value j + 16's in its high half."""
    q = torch.cat([torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)])
    weight = (0.5 * q - 1.0).reshape(1, 32)
    form = code_weight(weight)
    assert form is not None and form.kind == "q4"
    expected = [j | (15 - j) << 4 for j in range(16)]
    assert form.codes[0].tolist() == expected
    assert form.scales.tolist() == [[0.5]] and form.offsets.tolist() == [[-1.0]]
    assert torch.equal(_bits(form.decode()), _bits(weight))


@pytest.mark.parametrize("form", ["q4", "q8", "bf16"])
def test_each_form_gives_back_every_value_and_is_the_shortest_that_does(form):
    weight = _weight(form)
    short = code_weight(weight)
    assert short is not None and short.kind == form
    assert torch.equal(_bits(short.decode()), _bits(weight))
    assert short.nbytes == {"q4": 0.75, "q8": 1.125, "bf16": 2.0}[form] * weight.numel()


@pytest.mark.parametrize("change", ["one value an ulp off", "a negative zero", "random values", "a NaN"])
def test_a_weight_with_a_value_no_form_holds_is_not_coded(change):
    weight = _weight("q8")
    if change == "one value an ulp off":
        weight[3, 17] = torch.nextafter(weight[3, 17], torch.tensor(1.0))
    elif change == "a negative zero":  # an 8-bit code has no -0: q * d of a zero code is +0
        weight[5, 40] = -0.0
    elif change == "random values":
        weight = torch.randn(64, 576)
    else:
        weight[0, 0] = float("nan")
    assert code_weight(weight) is None


def test_weights_it_cannot_take_are_not_coded():
    assert code_weight(_weight("q4", columns=576)[:, :560]) is None  # rows not contiguous
    assert code_weight(q4_1(torch.randn(8, 64))[:, :48].contiguous()) is None  # 48 columns: not whole blocks
    assert code_weight(_weight("bf16").bfloat16()) is None  # not float32


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 13, 16, 33, 64, 100])
@pytest.mark.parametrize("form", ["q4", "q8", "bf16"])
def test_a_product_over_the_codes_has_the_bits_of_the_float32_product(form, rows, threads, monkeypatch):
    """Every decode-step row count (the tall tile at 7, 8 and 13-16 rows), more rows, one and two threads, a weight of
    several panels with a bias."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    weight = _weight(form, rows=300, columns=640)
    bias = torch.randn(300)
    x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows))
    expected = cpu.gemm_nt(x, weight, bias, torch.float32)
    assert torch.equal(_bits(gemm_nt_coded(x, code_weight(weight), bias)), _bits(expected))


def test_few_rows_is_the_c_kernels_limit():
    """The output layer's product (Python) and the projections' (C) take the codes up to the same row count."""
    source = (coded_weights.__file__.rsplit("/", 1)[0] + "/c/fused.c")
    with open(source) as f:
        assert f"#define CODED_MAX_ROWS {coded_weights.FEW_ROWS}" in f.read()
