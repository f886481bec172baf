"""The CUDA kernels (Triton) on this CPU, under ``TRITON_INTERPRET=1``: their arithmetic and their invariance.

The interpreter runs each program of a kernel with numpy, block by block, so what is checked here is the structure:
the blocks a sum is cut into never depend on the number of rows, queries or keys, and a query's keys are walked from
key 0 whatever layout holds them. (The tensor cores' own rounding inside a block is the hardware's; the GPU tier
checks the same properties on a GPU.) Needs triton (installed by scripts/setup.sh on Linux with a CPU torch).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py where there is no CUDA, before triton loads
    pytest.skip("on a machine with CUDA the gpu tier runs these kernels on the GPU", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux)")

from rlrunbook.kernels import gpu, ops

# triton 3.6's interpreter turns one-element arrays (loop bounds) into Python ints, which numpy 2.2 warns about
# (and numpy 2.3 refuses: hence numpy<2.3 where the interpreter runs); nothing of the kernels' own.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_products_are_right_and_a_rows_result_depends_on_that_row_only(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(70, 100, generator=generator).to(dtype)
    w = torch.randn(90, 100, generator=generator).to(dtype)
    bias = torch.randn(90, generator=generator)
    whole = gpu.gemm_nt(x, w, bias, torch.float32)
    assert (whole.double() - (x.double() @ w.double().T + bias.double())).abs().max() < 1e-4
    for rows in ([3], [69, 0], list(range(5, 70, 7))):  # alone, reordered, spread over other row tiles
        assert torch.equal(gpu.gemm_nt(x[rows], w, bias, torch.float32), whole[rows])
    as_seq = gpu.gemm_seq(x, w.t(), bias, torch.float32)
    assert torch.equal(as_seq, whole)  # the same kernel through other strides
    gradient = gpu.gemm_seq(x, w[:70].contiguous(), None, torch.float32, a_transposed=True)  # x.T @ w[:70]
    assert (gradient.double() - x.double().T @ w[:70].double()).abs().max() < 1e-4


def test_row_reductions_are_one_program_per_row():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2500, generator=generator) * 3
    x[2, ::3] = -float("inf")
    lse, sumsq = gpu.row_logsumexp(x), gpu.row_sumsq(x[[0, 1, 3]].bfloat16())
    assert torch.allclose(lse, torch.logsumexp(x, -1), atol=2e-6, rtol=0)
    assert torch.allclose(sumsq, (x[[0, 1, 3]].bfloat16().float() ** 2).sum(-1), rtol=1e-6)
    assert torch.equal(gpu.row_logsumexp(x[4:5]), lse[4:5]) and torch.equal(gpu.row_sumsq(x[[3]].bfloat16()), sumsq[2:])
    assert gpu.row_logsumexp(torch.full((1, 7), -float("inf")))[0] == -float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_and_its_gradients(dtype, on_triton):
    from test_fixed_order import check_attention_against_float64

    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 6, 64, generator=generator).to(dtype)
    k, v = (torch.randn(2, 70, 2, 64, generator=generator).to(dtype) for _ in range(2))  # two key blocks
    query_positions = torch.tensor([[0, 1, 2, 68, 69], [3, 4, 66, 67, -1]])
    key_positions = torch.arange(70)[None].repeat(2, 1)
    key_valid = torch.ones(2, 70, dtype=torch.bool)
    key_valid[1, :2] = False
    tolerance = 2e-5 if dtype == torch.float32 else 5e-2
    out = check_attention_against_float64(q, k, v, query_positions, key_positions, key_valid, tolerance, generator)
    assert torch.equal(out[1, 4], torch.zeros_like(out[1, 4]))


def test_a_query_gets_the_same_bits_alone_in_a_decode_window_and_in_a_training_row():
    """The decode step (one query over a longer window whose later slots it may not read) and the training pass
    (every query of the row, the future keys masked) walk the same key blocks from key 0."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 80, 4, 64, generator=generator).bfloat16()
    k, v = (torch.randn(1, 80, 2, 64, generator=generator).bfloat16() for _ in range(2))
    positions = torch.arange(80)[None]
    valid = torch.ones(1, 80, dtype=torch.bool)
    training, _ = gpu.attention_forward(q, k, v, positions, positions, valid, 0.1)
    window = torch.cat([k, torch.randn(1, 48, 2, 64, generator=generator).bfloat16()], dim=1)  # stale slots after
    values = torch.cat([v, torch.randn(1, 48, 2, 64, generator=generator).bfloat16()], dim=1)
    for t in (0, 63, 64, 79):
        step, _ = gpu.attention_forward(q[:, t:t + 1], window, values, torch.tensor([[t]]), torch.arange(128)[None],
                                        torch.ones(1, 128, dtype=torch.bool), 0.1)
        assert torch.equal(step[0, 0], training[0, t]), f"query {t}"


def test_a_tiny_models_decode_steps_equal_its_training_pass_through_triton(tiny_folder, on_triton):
    """The whole forward (products, norms, rotary, SiLU, attention, log-sum-exp) on the Triton kernels: each cached
    decode step's hidden state equals the shared-prefix training pass's at that token, bit for bit (bf16)."""
    from rlrunbook.engines.decoder import Decoder
    from rlrunbook.engines.layouts import RowCache, TreeLayout
    from rlrunbook.models import load_causal_lm
    from rlrunbook.prefix_tree import TokenTrie, plan_forward

    model = load_causal_lm(tiny_folder, dtype=torch.bfloat16)
    decoder = Decoder(model, "invariant")
    tokens = [1, 285, 201, 279, 261, 223, 40, 41, 300]
    with torch.no_grad():
        trie = TokenTrie()
        plan = plan_forward(trie, [tokens, tokens[:4] + [7, 8]])
        flat = plan.flat_of()
        full = decoder.hidden(torch.tensor([trie.tokens[n] for n in plan.nodes]),
                              torch.tensor([trie.positions[n] for n in plan.nodes]),
                              TreeLayout(plan.rows, flat, trie.positions, torch.device("cpu")))
        cache = RowCache(len(model.model.layers), 2, 16, decoder.num_kv_heads, decoder.head_dim, torch.bfloat16,
                         torch.device("cpu"))
        for t, token in enumerate(tokens):
            cache.lengths[:] = t
            step = decoder.hidden(torch.tensor([token, token]), cache.lengths.clone(), cache)
            assert torch.equal(step[0], full[flat[plan.paths[0][t]]]), f"position {t}"


def test_a_lora_training_step_through_triton_matches_the_c_kernels(tmp_path, monkeypatch):
    """``forward_backward`` on `tiny` (fp32, LoRA r4, three datums of different lengths sharing no prefix) through
    the Triton kernels: the loss and every adapter gradient equal the C kernels' to float32 rounding (each side sums
    in its own fixed order), so the backward kernels (products with transposed operands, attention's dq, dk, dv)
    compute the same gradients the CPU path does."""
    from tinker import types

    from rlrunbook.backend import LocalServiceClient, LocalSettings
    from rlrunbook.kernels import cpu
    from rlrunbook.tokens import build_datum_arrays

    data = []
    for index, length in enumerate([12, 20, 9]):
        ids = list(range(10 + index, 10 + index + length))
        arrays = build_datum_arrays(ids[: length // 2], ids[length // 2:], None, [1.0] * (length - length // 2))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                loss_fn_inputs={"target_tokens": arrays.target_tokens,
                                                "weights": [1.0] * len(arrays.target_tokens)}))

    def step(backend, folder):
        monkeypatch.setattr(ops, "_backend", lambda device: backend)
        settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / folder)
        with LocalServiceClient(settings) as service:
            training = service.create_lora_training_client("tiny", rank=4, seed=0)
            loss = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
            return loss, {name: p.grad.clone() for name, p in training._trainer.model.named_parameters()
                          if p.grad is not None}

    (c_loss, c_grads), (t_loss, t_grads) = step(cpu, "c"), step(gpu, "triton")
    assert abs(c_loss - t_loss) <= 1e-5 * abs(c_loss)
    assert c_grads.keys() == t_grads.keys() and len(c_grads) > 0
    scale = max(g.abs().max() for g in c_grads.values())
    assert all((c_grads[name] - t_grads[name]).abs().max() <= 1e-5 * scale for name in c_grads)
