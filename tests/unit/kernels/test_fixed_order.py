"""The fixed-order CPU kernels compute the sums their docstrings state, in exactly that order.

Each order is re-implemented here in numpy, one float32 addition at a time, on inputs whose products are
exact in float32 (values with at most 8 significant bits, as bfloat16 numbers have): a fused multiply-add
and a multiply-then-add then give the same bits, so the reference is exact and the kernels must equal it
bit for bit. A kernel that summed in any other order (a library's GEMM, a split of the sum across threads,
another lane count) would differ in the last bits of some outputs: the last test shows that for the
library's own kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rlrunbook.kernels import build, cpu, ops


def _bf16_valued(*shape, seed: int, spread: float = 3.0) -> torch.Tensor:
    """float32 values that bfloat16 represents exactly, spread over several binades (so order matters)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=generator) * torch.exp2(torch.randint(-4, 4, shape, generator=generator)
                                                                  * spread / 4)
    return values.bfloat16().float()


def _tree16(lanes: np.ndarray) -> np.float32:
    s = [np.float32(lanes[j] + lanes[j + 8]) for j in range(8)]
    t = [np.float32(s[j] + s[j + 4]) for j in range(4)]
    u = [np.float32(t[j] + t[j + 2]) for j in range(2)]
    return np.float32(u[0] + u[1])


def lanes16(a: np.ndarray, b: np.ndarray) -> np.float32:
    """lanes16: lane j adds the terms at k = j (mod 16) in increasing k; then the fixed tree."""
    lanes = np.zeros(16, dtype=np.float32)
    for k in range(len(a)):
        lanes[k % 16] = np.float32(lanes[k % 16] + np.float32(a[k] * b[k]))
    return _tree16(lanes)


def pairs16(a: np.ndarray, b: np.ndarray) -> np.float32:
    """pairs16: in each block of 32 k, lane j adds the term at 2j + 1, then the one at 2j; then the fixed tree."""
    lanes = np.zeros(16, dtype=np.float32)
    for block in range(0, len(a), 32):
        for j in range(16):
            for k in (block + 2 * j + 1, block + 2 * j):
                if k < len(a):
                    lanes[j] = np.float32(lanes[j] + np.float32(a[k] * b[k]))
    return _tree16(lanes)


def sequential(a: np.ndarray, b: np.ndarray) -> np.float32:
    total = np.float32(0.0)
    for k in range(len(a)):
        total = np.float32(total + np.float32(a[k] * b[k]))
    return total


def _reference(order, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xs, ws = x.numpy(), w.numpy()
    return torch.tensor([[order(xs[m], ws[n]) for n in range(ws.shape[0])] for m in range(xs.shape[0])])


@pytest.mark.parametrize("k", [1, 15, 16, 33, 100, 577])
def test_gemm_nt_float32_is_the_lanes16_sum(k):
    x, w = _bf16_valued(5, k, seed=k), _bf16_valued(7, k, seed=k + 1)
    assert torch.equal(cpu.gemm_nt(x, w, None, torch.float32), _reference(lanes16, x, w))


@pytest.mark.parametrize("rows", [1, 7, 8, 13, 16, 17])
def test_gemm_nt_float32_at_a_decode_steps_rows_is_the_lanes16_sum(rows):
    """Row counts a decode step has (an AVX-512 build takes an 8 x 3 tile at 7, 8 and 13-16 rows, 6 x 4 at others),
    over enough B rows (200: four panels) that each work item requests the next panel's lines while it computes, and
    a column count that fills neither tile's last column group."""
    x, w = _bf16_valued(rows, 100, seed=rows), _bf16_valued(202, 100, seed=rows + 1)
    assert torch.equal(cpu.gemm_nt(x, w, None, torch.float32), _lanes16_all(x, w))


@pytest.mark.parametrize("k", [1, 31, 32, 33, 100, 577])
def test_gemm_nt_bfloat16_is_the_pairs16_sum(k):
    x, w = _bf16_valued(5, k, seed=k), _bf16_valued(7, k, seed=k + 1)
    out = cpu.gemm_nt(x.bfloat16(), w.bfloat16(), None, torch.float32)
    assert torch.equal(out, _reference(pairs16, x, w))


@pytest.mark.parametrize("k", [1, 17, 64, 300])
def test_gemm_seq_float32_is_the_sequential_sum(k):
    x, w = _bf16_valued(5, k, seed=k), _bf16_valued(40, k, seed=k + 1)
    expected = _reference(sequential, x, w)
    assert torch.equal(cpu.gemm_seq(x, w.t().contiguous(), None, torch.float32), expected)
    # the transposed form of A gives the same sums (as for a weight gradient)
    assert torch.equal(cpu.gemm_seq(x.t().contiguous(), w.t().contiguous(), None, torch.float32, a_transposed=True),
                       expected)


def _lanes16_all(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """lanes16 for every (row, column) at once: numpy float32 additions, elementwise, in the same order."""
    xs, ws = x.numpy(), w.numpy()
    lanes = np.zeros((xs.shape[0], ws.shape[0], 16), dtype=np.float32)
    for k in range(xs.shape[1]):
        lanes[:, :, k % 16] = lanes[:, :, k % 16] + (xs[:, k, None] * ws[None, :, k]).astype(np.float32)
    s = lanes[..., :8] + lanes[..., 8:]
    t = s[..., :4] + s[..., 4:]
    u = t[..., :2] + t[..., 2:]
    return torch.from_numpy(u[..., 0] + u[..., 1])


@pytest.mark.parametrize("n", [65, 130, 577, 960])
def test_every_column_of_a_product_split_into_panels_is_the_lanes16_sum(n):
    """The threads take panels of B's rows (about 64, as many as a multiple of the threads): whatever the split, each
    column is computed once, in lanes16 order, on 1, 2 or 3 threads."""
    x, w = _bf16_valued(6, 40, seed=n), _bf16_valued(n, 40, seed=n + 1)
    expected = _lanes16_all(x, w)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(cpu.gemm_nt(x, w, None, torch.float32), expected), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [1, 17, 64])
def test_a_short_sum_over_many_rows_is_the_sequential_sum_and_each_rows_own(k):
    """Over at most 64 terms and many rows (a LoRA update at a training pass's size) the threads take whole row blocks
    and go along their rows: each element is still the sequential sum, with the bits a few rows alone get (another
    path), for float32 and for bfloat16 inputs."""
    x, w = _bf16_valued(70, k, seed=k), _bf16_valued(100, k, seed=k + 1)
    xs, ws = x.numpy(), w.numpy()
    expected = np.zeros((70, 100), dtype=np.float32)
    for i in range(k):
        expected = expected + (xs[:, i, None] * ws[None, :, i]).astype(np.float32)
    wt = w.t().contiguous()
    assert torch.equal(cpu.gemm_seq(x, wt, None, torch.float32), torch.from_numpy(expected))
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(70, k).to(dtype), torch.randn(k, 100).to(dtype)
        many = cpu.gemm_seq(a, b, None, torch.float32)
        assert torch.equal(torch.cat([cpu.gemm_seq(a[i:i + 5], b, None, torch.float32) for i in range(0, 70, 5)]),
                           many)


@pytest.mark.parametrize("k", [4096, 4229])
def test_a_sum_over_a_vocabulary_is_the_sequential_sum_and_each_rows_own(k):
    """Over thousands of terms (the gradient through an output layer) each thread keeps its rows' sums for every column
    and goes along k in chunks: each element is still the sequential sum, with the bits a few rows alone get (another
    path), on 1, 2 and 3 threads, for float32 and for bfloat16 inputs (k odd: the last pair half empty)."""
    x, w = _bf16_valued(40, k, seed=k, spread=1.0), _bf16_valued(k, 45, seed=k + 1, spread=1.0)
    _assert_sequential_and_each_rows_own(x, w, slice_rows=5)


@pytest.mark.parametrize("k", [300, 301])
def test_a_sum_over_many_rows_is_the_sequential_sum_and_each_rows_own(k):
    """Over many rows (a training pass's gradient through a frozen weight) the threads take groups of row blocks and go
    along k chunk by chunk, every panel of B in each chunk (a last chunk and panel partial): each element is still the
    sequential sum, with the bits a few rows alone get (another path), on 1, 2 and 3 threads, for float32 and for
    bfloat16 inputs (k odd: the last pair half empty)."""
    x, w = _bf16_valued(400, k, seed=k, spread=1.0), _bf16_valued(k, 70, seed=k + 1, spread=1.0)
    _assert_sequential_and_each_rows_own(x, w, slice_rows=50)


def _assert_sequential_and_each_rows_own(x: torch.Tensor, w: torch.Tensor, slice_rows: int,
                                         a_transposed: bool = False) -> None:
    """``gemm_seq(x, w)`` (``x`` ``[M, K]``, passed transposed with ``a_transposed``) is the sequential sum (numpy's
    float32 additions in increasing k), and for float32 and bfloat16 inputs the bits of ``slice_rows``-row slices
    alone, on 1, 2 and 3 threads."""
    xs, ws = x.numpy(), w.numpy()
    expected = np.zeros((x.shape[0], w.shape[1]), dtype=np.float32)
    for i in range(x.shape[1]):
        expected = expected + (xs[:, i, None] * ws[None, i, :]).astype(np.float32)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            a = x.t().contiguous() if a_transposed else x
            out = cpu.gemm_seq(a, w, None, torch.float32, a_transposed=a_transposed)
            assert torch.equal(out, torch.from_numpy(expected)), f"{count} threads"
            for dtype in (torch.float32, torch.bfloat16):
                a, b = x.to(dtype), w.to(dtype)
                many = cpu.gemm_seq(a, b, None, torch.float32)
                alone = torch.cat([cpu.gemm_seq(a[i:i + slice_rows], b, None, torch.float32)
                                   for i in range(0, x.shape[0], slice_rows)])
                assert torch.equal(many, alone), f"{dtype}, {count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [8, 16, 20, 32, 36])
def test_a_long_sum_over_a_ranks_rows_is_the_sequential_sum_and_each_rows_own(rows):
    """Over more than 64 terms and a LoRA rank's rows (a factor's gradient, A transposed: the sum over the tokens), the
    rows go in tiles of 8 where 12-row tiles would compute rows in vain (8, 16, 20, 32) and of 12 where not (36):
    each element is still the sequential sum across a chunk of k (700 terms), with the bits a few rows alone get, on 1,
    2 or 3 threads, for float32 and for bfloat16 inputs."""
    x, w = _bf16_valued(rows, 700, seed=rows, spread=1.0), _bf16_valued(700, 70, seed=rows + 1, spread=1.0)
    _assert_sequential_and_each_rows_own(x, w, slice_rows=4, a_transposed=True)


@pytest.mark.parametrize("rows", [1, 7, 9, 12, 16, 17, 36, 63])
def test_a_short_sum_over_few_rows_is_the_sequential_sum(rows):
    """Over at most 64 terms and fewer than 64 rows (a decode step's LoRA update) the threads split B's columns and
    read B where it is, the last panel (4 of 100 columns) copied: each element is still the sequential sum, whether
    the rows go in tiles of 8 (16 rows: none in vain) or 12 (12 and 36 rows), on 1, 2 or 3 threads."""
    threads = torch.get_num_threads()
    try:
        for k in (1, 16, 64):
            x, w = _bf16_valued(rows, k, seed=rows + k), _bf16_valued(100, k, seed=rows + k + 1)
            xs, ws = x.numpy(), w.numpy()
            expected = np.zeros((rows, 100), dtype=np.float32)
            for i in range(k):
                expected = expected + (xs[:, i, None] * ws[None, :, i]).astype(np.float32)
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                out = cpu.gemm_seq(x, w.t().contiguous(), None, torch.float32)
                assert torch.equal(out, torch.from_numpy(expected)), f"{k} terms, {count} threads"
    finally:
        torch.set_num_threads(threads)


def test_bias_is_added_once_after_the_sum_and_the_result_rounded_once():
    x, w = _bf16_valued(3, 70, seed=1), _bf16_valued(4, 70, seed=2)
    bias = torch.randn(4)
    expected = (_reference(lanes16, x, w) + bias).bfloat16()
    assert torch.equal(cpu.gemm_nt(x, w, bias, torch.bfloat16), expected)


def test_row_sumsq_is_the_lanes16_sum_of_squares():
    x = _bf16_valued(6, 577, seed=3)
    expected = torch.tensor([lanes16(row, row) for row in x.numpy()])
    assert torch.equal(cpu.row_sumsq(x), expected)
    assert torch.equal(cpu.row_sumsq(x.bfloat16()), expected)


def test_a_rows_result_depends_on_that_row_only():
    """Every row alone, in any subset of rows and at any position gives the same bits (products, bf16 and fp32)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(37, 576).to(dtype), torch.randn(200, 576).to(dtype)
        whole = cpu.gemm_nt(x, w, None, dtype)
        seq = cpu.gemm_seq(x, w.t().contiguous(), None, dtype)
        for rows in ([5], [36, 0], list(range(3, 20)), list(range(36, -1, -3))):
            assert torch.equal(cpu.gemm_nt(x[rows], w, None, dtype), whole[rows])
            assert torch.equal(cpu.gemm_seq(x[rows], w.t().contiguous(), None, dtype), seq[rows])


def test_thread_count_does_not_change_a_bit():
    x, w = torch.randn(50, 1536), torch.randn(300, 1536)
    q, k, v = torch.randn(3, 20, 6, 64), torch.randn(3, 20, 2, 64), torch.randn(3, 20, 2, 64)
    positions = torch.arange(20)[None].repeat(3, 1)
    valid = torch.ones(3, 20, dtype=torch.bool)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in sorted({1, 2, threads}):
            torch.set_num_threads(count)
            results.append((cpu.gemm_nt(x, w, None, torch.float32), cpu.gemm_seq(x, w.t().contiguous(), None,
                                                                                 torch.float32),
                            cpu.row_logsumexp(x), cpu.attention_forward(q, k, v, positions, positions, valid, 0.1)[0]))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_exp_is_within_two_ulp_and_the_same_for_an_element_anywhere():
    x = torch.linspace(-103, 88.7, 200_003)
    got, exact = cpu.exp(x).double(), torch.exp(x.double())
    ulp = torch.exp2(torch.floor(torch.log2(exact.clamp(min=2.0 ** -126)) - 23))
    assert ((got - exact).abs() <= 2 * ulp).all()
    special = cpu.exp(torch.tensor([-float("inf"), float("nan"), 0.0, -104.0, 89.0]))
    assert special[0] == 0 and special[1].isnan() and special[2] == 1 and special[3] == 0 and special[4].isinf()
    for offset in (1, 5, 15):  # where an element falls in the vectors (and the tail) changes nothing
        assert torch.equal(cpu.exp(x[offset:]), cpu.exp(x)[offset:])
    # (PyTorch's own silu differs with the offset on this kind of CPU: its vector and scalar tails round apart)


def test_row_logsumexp_is_the_lanes64_sum_of_the_kernels_exp():
    x = torch.randn(3, 1000) * 4
    x[1, ::3] = -float("inf")  # a filtered row (top-k, top-p)
    for row, got in zip(x, cpu.row_logsumexp(x), strict=True):
        terms = cpu.exp(row - row.max()).numpy()
        lanes = np.zeros(64, dtype=np.float32)
        for v, term in enumerate(terms):
            lanes[v % 64] = np.float32(lanes[v % 64] + term)
        lanes = lanes[:32] + lanes[32:]
        lanes = lanes[:16] + lanes[16:]
        expected = np.float32(row.max().item()) + np.log(np.float64(_tree16(lanes)))  # libm's log may round apart
        assert abs(got.item() - expected) <= np.spacing(np.float32(expected))


def test_row_logsumexp_matches_float64_and_handles_masked_rows():
    x = torch.randn(7, 49152) * 4
    x[3, ::2] = -float("inf")  # a filtered row (top-k, top-p)
    got = cpu.row_logsumexp(x)
    assert torch.allclose(got.double(), torch.logsumexp(x.double(), -1), rtol=0, atol=3e-6)
    assert cpu.row_logsumexp(torch.full((1, 9), -float("inf")))[0] == -float("inf")
    assert cpu.row_logsumexp(torch.tensor([[0.0, float("nan")]]))[0].isnan()


def test_rope_table_is_the_float32_angle_through_libm():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    positions = torch.tensor([0, 1, 7, 1000, 32767])
    cos, sin = cpu.rope_table(positions, inv_freq)
    angle = (positions[:, None].float() * inv_freq[None]).double()  # float32 product, as transformers computes it
    assert torch.equal(cos, torch.cos(angle).float()) and torch.equal(sin, torch.sin(angle).float())


def check_attention_against_float64(q, k, v, query_positions, key_positions, key_valid, tolerance, generator):
    """``ops.attention`` of ``q``, ``k``, ``v`` (scale 0.125) and its three gradients for an output gradient drawn
    from ``generator``, each within ``tolerance`` of the float64 reference; returns the output."""
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*mine, query_positions, key_positions, key_valid, 0.125)
    grad = torch.randn(out.shape, generator=generator).to(q.dtype)
    out.backward(grad)
    reference = [t.double().requires_grad_() for t in (q, k, v)]
    expected = _reference_attention(*reference, query_positions, key_positions, key_valid, 0.125)
    expected.backward(grad.double())
    assert (out.double() - expected).abs().max() <= tolerance
    for got, want in zip(mine, reference, strict=True):
        assert (got.grad.double() - want.grad).abs().max() <= tolerance
    return out


def _reference_attention(q, k, v, query_positions, key_positions, key_valid, scale):
    groups = q.shape[2] // k.shape[2]
    keys, values = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("rthd,rshd->rhts", q, keys) * scale
    allowed = key_valid[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])
    weights = torch.softmax(scores.masked_fill(~allowed[:, None], -float("inf")), -1).nan_to_num(0.0)
    return torch.einsum("rhts,rshd->rthd", weights, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_and_its_gradients_match_float64(dtype):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 6, 64, generator=generator).to(dtype)
    k, v = (torch.randn(3, 9, 2, 64, generator=generator).to(dtype) for _ in range(2))
    query_positions = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, -1], [8, 7, 6, 5, 4]])
    key_positions = torch.arange(9)[None].repeat(3, 1)
    key_valid = torch.ones(3, 9, dtype=torch.bool)
    key_valid[1, 0] = False
    tolerance = 2e-6 if dtype == torch.float32 else 3e-2
    out = check_attention_against_float64(q, k, v, query_positions, key_positions, key_valid, tolerance, generator)
    assert torch.equal(out[1, 4], torch.zeros_like(out[1, 4]))  # the padding query


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_over_blocks_of_keys_matches_float64(dtype, head_dim):
    """45 keys: the kernel lays float32 keys out 16 x 16 values at a time (two whole blocks, then 13 keys and, at a
    head size of 40, 8 dimensions past the last whole block, one value at a time)."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 6, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(2, 45, 2, head_dim, generator=generator).to(dtype) for _ in range(2))
    query_positions = torch.tensor([[41, 42, 43, 44], [15, 16, 31, 44]])
    key_positions = torch.arange(45)[None].repeat(2, 1)
    key_valid = torch.ones(2, 45, dtype=torch.bool)
    tolerance = 2e-6 if dtype == torch.float32 else 3e-2
    check_attention_against_float64(q, k, v, query_positions, key_positions, key_valid, tolerance, generator)


def test_a_query_reads_its_keys_in_order_whatever_else_the_batch_holds():
    """One query alone, beside other rows, and with its keys spread out by invalid (padding) keys: the same bits."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(4, 6, 4, 64, generator=generator).bfloat16()
    k, v = (torch.randn(4, 12, 2, 64, generator=generator).bfloat16() for _ in range(2))
    positions = torch.arange(12)[None].repeat(4, 1)
    valid = torch.ones(4, 12, dtype=torch.bool)
    batch = ops.attention(q, k, v, positions[:, 6:], positions, valid, 0.1)
    alone = ops.attention(q[2:3, 3:4], k[2:3, :10], v[2:3, :10], positions[2:3, 9:10], positions[:1, :10],
                          valid[:1, :10], 0.1)
    assert torch.equal(alone[0, 0], batch[2, 3])
    # the same keys with padding slots between them (a layout that interleaves another row's slots)
    padded_k = torch.zeros(1, 24, 2, 64, dtype=torch.bfloat16)
    padded_v = torch.zeros_like(padded_k)
    padded_k[0, ::2], padded_v[0, ::2] = k[2], v[2]
    padded_positions = torch.arange(24)[None] // 2
    padded_valid = (torch.arange(24) % 2 == 0)[None]
    spread = ops.attention(q[2:3, 3:4], padded_k, padded_v, positions[2:3, 9:10], padded_positions, padded_valid, 0.1)
    assert torch.equal(spread[0, 0], batch[2, 3])


def test_the_librarys_product_is_not_the_fixed_order():
    """The control: on the same exact inputs the library's GEMM (MKL) rounds differently from lanes16 somewhere,
    so the tests above can tell the fixed order from a library kernel."""
    x, w = _bf16_valued(16, 577, seed=5), _bf16_valued(64, 577, seed=6)
    assert not torch.equal(F.linear(x, w), cpu.gemm_nt(x, w, None, torch.float32))


def test_float16_is_computed_from_its_exact_float32_values():
    """The C kernels read float32 and bfloat16; a float16 model's tensors are widened exactly and rounded back once."""
    x, w = _bf16_valued(5, 100, seed=7).half(), _bf16_valued(6, 100, seed=8).half()
    assert torch.equal(ops.linear(x, w), cpu.gemm_nt(x.float(), w.float(), None, torch.float32).half())
    q = torch.randn(1, 4, 2, 64).half()
    k = torch.randn(1, 4, 1, 64).half()
    positions, valid = torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool)
    out = ops.attention(q, k, k, positions, positions, valid, 0.1)
    assert out.dtype == torch.float16
    assert torch.equal(out, ops.attention(q.float(), k.float(), k.float(), positions, positions, valid, 0.1).half())


AVX512_HOST = pytest.mark.skipif(not {"avx2", "fma", "avx512f"} <= set(build._cpu_flags().split()),
                                 reason="needs an x86 CPU with AVX-512, to run an AVX2 build beside this machine's own")


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernels built for AVX2 (``-march=x86-64-v3``), loaded beside this machine's own build."""
    return build.load_variant(tmp_path_factory.mktemp("avx2"), ("-march=x86-64-v3", "-fopenmp"))


def _gemm_nt_of(library, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` in float32 by another build's ``gemm_nt`` (``a``, ``b`` float32 or bfloat16, contiguous)."""
    import ctypes

    (rows, k), n = a.shape, b.shape[0]
    out = torch.empty(rows, n)
    code = 0 if a.dtype == torch.float32 else 1
    library.gemm_nt(ctypes.c_void_p(a.data_ptr()), code, k, ctypes.c_void_p(b.data_ptr()), code, k, None,
                    ctypes.c_void_p(out.data_ptr()), 0, n, rows, n, k, 2)
    return out


@AVX512_HOST
def test_the_vector_width_changes_no_bit(avx2_build):
    """The orders are stated per element, not per register: the kernels built for AVX2 (8-lane registers, no bf16
    instruction) give the same bits as this machine's AVX-512 build (16 lanes, VDPBF16PS where it has it)."""
    import ctypes

    other = avx2_build
    generator = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(37, 577, generator=generator).to(dtype)
        b = torch.randn(70, 577, generator=generator).to(dtype)
        assert torch.equal(_gemm_nt_of(other, a, b), cpu.gemm_nt(a, b, None, torch.float32)), dtype
    x = torch.randn(3, 1000, generator=generator) * 4
    lse = torch.empty(3)
    other.row_logsumexp(ctypes.c_void_p(x.data_ptr()), 1000, 3, 1000, ctypes.c_void_p(lse.data_ptr()), 2)
    assert torch.equal(lse, cpu.row_logsumexp(x))


@AVX512_HOST
def test_an_avx2_build_codes_and_decodes_weights_to_the_same_bits(avx2_build):
    """The coded weights' widening has an AVX2 path of its own: that build finds the codes this machine's finds and
    its product over them has the float32 product's bits (kernels/coded_weights.py)."""
    import ctypes

    from rlrunbook.kernels.coded_weights import KINDS, code_weight
    from rlrunbook.testing.quantized import q4_1, q8_0

    generator = torch.Generator().manual_seed(11)
    x = torch.randn(5, 576, generator=generator)

    def p(t):
        return None if t is None else ctypes.c_void_p(t.data_ptr())

    for weight in (q4_1(torch.randn(70, 576, generator=generator)), q8_0(torch.randn(70, 576, generator=generator)),
                   torch.randn(70, 576, generator=generator).bfloat16().float()):
        mine = code_weight(weight)
        codes, scales, offsets = (torch.empty_like(t) for t in (mine.codes, mine.scales, mine.offsets))
        kind = KINDS[mine.kind]
        assert avx2_build.code_weight(p(weight), 576, 70, 576, kind, p(codes), p(scales), p(offsets), 2) == 0
        assert torch.equal(codes, mine.codes) and torch.equal(scales, mine.scales), mine.kind
        out = torch.empty(5, 70)
        assert avx2_build.gemm_nt_coded(p(x), 576, kind, p(codes), p(scales), p(offsets), None, p(out), 0, 70, 5,
                                        70, 576, 2) == 0
        assert torch.equal(out, cpu.gemm_nt(x, weight, None, torch.float32)), mine.kind


AVX512_BF16_HOST = pytest.mark.skipif(not {"avx512f", "avx512_bf16"} <= set(build._cpu_flags().split()),
                                      reason="needs an x86 CPU with AVX-512 and its bf16 instruction")


@AVX512_BF16_HOST
def test_the_bf16_instruction_changes_no_bit(tmp_path):
    """An AVX-512 build without the bf16 instruction (pairs16 as two float32 multiply-adds per step, in a 4-row tile
    where this machine's build uses 6 rows) gives the same products as this machine's: float32 and bf16 ``gemm_nt``
    over row counts that fill neither tile, and bf16 ``gemm_seq``, whose pairs take the same step."""
    import ctypes

    other = build.load_variant(tmp_path, ("-march=native", "-mno-avx512bf16", "-mtune=generic", "-fopenmp"))
    assert other.nt_uses_bf16_instruction() == 0 and cpu.load_library().nt_uses_bf16_instruction() == 1
    generator = torch.Generator().manual_seed(10)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 5, 7, 37):
            a = torch.randn(rows, 577, generator=generator).to(dtype)
            b = torch.randn(70, 577, generator=generator).to(dtype)
            assert torch.equal(_gemm_nt_of(other, a, b), cpu.gemm_nt(a, b, None, torch.float32)), (dtype, rows)
    a = torch.randn(13, 301, generator=generator).bfloat16()
    b = torch.randn(301, 45, generator=generator).bfloat16()
    out = torch.empty(13, 45)
    other.gemm_seq(ctypes.c_void_p(a.data_ptr()), 1, 301, 1, ctypes.c_void_p(b.data_ptr()), 1, 45, None,
                   ctypes.c_void_p(out.data_ptr()), 0, 45, 13, 45, 301, 2)
    assert torch.equal(out, cpu.gemm_seq(a, b, None, torch.float32))


def _attention_and_gradients(generator, dtype, heads, kv_heads, dim):
    """Attention of 2 rows x 9 queries over 30 keys (some not allowed, one query padding) and its three gradients."""
    q = torch.randn(2, 9, heads, dim, generator=generator).to(dtype)
    k, v = (torch.randn(2, 30, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    grad_out = torch.randn(2, 9, heads, dim, generator=generator).to(dtype)
    key_positions = torch.arange(30).expand(2, 30).contiguous()
    query_positions = (torch.arange(9) + 21).expand(2, 9).clone()
    query_positions[1, 4] = -1
    valid = torch.rand(2, 30, generator=generator) > 0.2
    out, lse = cpu.attention_forward(q, k, v, query_positions, key_positions, valid, 0.125)
    return (out, lse, *cpu.attention_backward(q, k, v, query_positions, key_positions, valid, out, grad_out, lse, 0.125))


@AVX512_HOST
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_vector_width_changes_no_bit_of_attention_or_its_gradients(avx2_build, monkeypatch, dtype):
    """Attention's sums hold their order in an AVX2 build too: one query head per key/value head, three (as
    SmolLM2), and a head dimension that ends inside a vector. Every product term is one fused multiply-add in both
    builds, whichever loop the compiler finds it in."""
    for heads, kv_heads, dim in ((4, 4, 40), (9, 3, 64), (2, 1, 24)):
        generator = torch.Generator().manual_seed(heads * 100 + dim)
        mine = _attention_and_gradients(generator, dtype, heads, kv_heads, dim)
        with monkeypatch.context() as patch:
            patch.setattr(cpu, "load_library", lambda: avx2_build)
            generator = torch.Generator().manual_seed(heads * 100 + dim)
            theirs = _attention_and_gradients(generator, dtype, heads, kv_heads, dim)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), mine, theirs):
            assert torch.equal(a, b), (heads, kv_heads, dim, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lora_update_added_in_one_pass_is_the_chain_bit_for_bit(dtype):
    """``ops.add_scaled`` (the trainer adds each LoRA update to its base result in one C pass) gives the bits and the
    gradients of ``result + delta * scaling``: the product rounded to the dtype before the sum, as PyTorch rounds it.
    The base result is a column slice of a wider product, as a stacked projection's is."""
    generator = torch.Generator().manual_seed(21)
    wide = (torch.randn(37, 300, generator=generator) * 3).to(dtype).requires_grad_()
    delta = (torch.randn(37, 200, generator=generator) * 1e-3).to(dtype).requires_grad_()
    grad = torch.randn(37, 200, generator=generator).to(dtype)
    outputs = []
    for combine in (ops.add_scaled, lambda r, d, s: r + d * s):
        result = wide[:, 50:250]
        out = combine(result, delta, 0.37)
        out.backward(grad)
        outputs.append((out.detach(), wide.grad.clone(), delta.grad.clone()))
        wide.grad = delta.grad = None
    for name, fused_value, chain_value in zip(("out", "d result", "d delta"), *outputs, strict=True):
        assert torch.equal(fused_value, chain_value), name
    assert outputs[0][0].is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rotation_in_one_pass_is_the_chain_bit_for_bit(dtype):
    """``ops.rotary`` on CPU (the trainer's rotary positions on CPU, one C pass each way) gives the bits of transformers'
    chain ``x * cos + rotate_half(x) * sin`` and of its gradient: every product rounded to the dtype before the sum,
    and rotate_half's transpose in the backward. x is the query part of a wider row, as a stacked projection's
    output is; it holds zeros of both signs and large values, and the gradient reaches both halves of a head."""
    from rlrunbook.engines.decoder import rotate

    generator = torch.Generator().manual_seed(23)
    rows, heads, dim = 37, 3, 64
    wide = (torch.randn(rows, heads * dim + 40, generator=generator) * 3).to(dtype)
    wide[0, :4] = torch.tensor([0.0, -0.0, 3e4, -3e4]).to(dtype)
    wide.requires_grad_()
    angles = torch.randn(rows, dim // 2, generator=generator) * 5
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    grad = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    outputs = []
    for turn in (ops.rotary, lambda x, c, s: rotate(x, c[:, None, :], s[:, None, :])):
        x = wide[:, 20:20 + heads * dim].view(rows, heads, dim)
        out = turn(x, cos, sin)
        out.backward(grad)
        outputs.append((out.detach(), wide.grad.clone()))
        wide.grad = None
    assert ops.rotation_applies(wide[:, :heads * dim].view(rows, heads, dim), cos)
    for name, fused_value, chain_value in zip(("out", "d x"), *outputs, strict=True):
        assert torch.equal(fused_value, chain_value), name


class _Calls(TorchDispatchMode):
    """Counts the calls of one aten operator (``aten::mul``, say) run inside the block."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.count = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name == self.name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scaling", [1.0, 2.0, 0.37])
def test_a_lora_updates_gradient_is_the_chains_and_unscaled_at_one(scaling):
    """``ops.lora_added``'s and ``ops.add_scaled``'s gradients equal the chain ``base + linear(xa, b) * scaling``'s
    bit for bit (the gradient holds -0, a subnormal and a NaN); at a scaling of 1 (alpha = rank) no product with the
    scaling is computed: the update's gradient is the output's gradient itself, not a copy."""
    generator = torch.Generator().manual_seed(8)
    base = torch.randn(33, 40, generator=generator).requires_grad_()
    xa = torch.randn(33, 6, generator=generator).requires_grad_()
    b = torch.randn(40, 6, generator=generator).requires_grad_()
    grad = torch.randn(33, 40, generator=generator)
    grad[0, :3] = torch.tensor([-0.0, 1e-40, float("nan")])
    results = []
    fused = (ops.lora_added, lambda r, u, w, s: ops.add_scaled(r, ops.linear(u, w, None), s))
    for combine in (*fused, lambda r, u, w, s: r + ops.linear(u, w, None) * s):
        out = combine(base, xa, b, scaling)
        with _Calls("aten::mul") as muls:
            results.append(torch.autograd.grad(out, (base, xa, b), grad))
        if combine in fused and scaling == 1.0:
            assert muls.count == 0, len(results)
    for fused in results[:2]:
        for name, got, want in zip(("d base", "d xa", "d b"), fused, results[2], strict=True):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scaling, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gated_activation_in_one_pass_is_the_chain_bit_for_bit(dtype):
    """``ops.silu_mul`` (the trainer's ``silu(gate) * up`` as one C pass each way, sigmoid recomputed in the backward)
    gives the bits of ``ops.silu(gate) * up`` and of both its gradients: every product rounded where the chain's
    autograd rounds it. gate and up are column slices of one wider tensor, as a stacked projection's are; the gate
    holds zeros of both signs, saturated values and a subnormal."""
    generator = torch.Generator().manual_seed(22)
    wide = (torch.randn(37, 300, generator=generator) * 4).to(dtype)
    wide[0, :5] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-39]).to(dtype)
    wide.requires_grad_()
    grad = torch.randn(37, 133, generator=generator).to(dtype)
    outputs = []
    for combine in (ops.silu_mul, lambda g, u: ops.silu(g) * u):
        out = combine(wide[:, :133], wide[:, 150:283])
        out.backward(grad)
        outputs.append((out.detach(), wide.grad.clone()))
        wide.grad = None
    for name, fused_value, chain_value in zip(("out", "d gate and up"), *outputs, strict=True):
        assert torch.equal(fused_value, chain_value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_gate_up_group_gets_its_gradient_without_a_copy(dtype):
    """A gate/up group's outputs split by ``ops.split_columns`` into ``ops.silu_mul``: the group's gradient is the
    tensor the activation's backward wrote both halves into (no ``cat``), the bits of ``split``'s backward. Pieces
    whose gradients are separate tensors, or a piece without one, are joined as ``split`` joins them."""
    generator = torch.Generator().manual_seed(4)
    group = (torch.randn(23, 2 * 40, generator=generator) * 3).to(dtype).requires_grad_()
    grad = torch.randn(23, 40, generator=generator).to(dtype)
    gradients = {}
    for name, split in (("split_columns", ops.split_columns), ("split", lambda x, s: x.split(s, dim=-1))):
        gate, up = split(group, (40, 40))
        out = ops.silu_mul(gate, up)
        with _Calls("aten::cat") as cats:
            (gradients[name],) = torch.autograd.grad(out, group, grad)
        assert cats.count == (0 if name == "split_columns" else 1), name
    assert torch.equal(gradients["split_columns"], gradients["split"])
    for combine in (lambda a, b, c: (a * 2).sum() + (c * 3).sum(), lambda a, b, c: (a * b[:, :10]).sum()):
        joined = torch.autograd.grad(combine(*ops.split_columns(group, (10, 30, 40))), group)[0]
        plain = torch.autograd.grad(combine(*group.split((10, 30, 40), dim=-1)), group)[0]
        assert torch.equal(joined, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_frozen_output_layer_gives_the_chains_logprobs_and_the_float64_gradient(dtype):
    """ops.frozen_head_logprobs: the logprobs of linear + log_softmax_at bit for bit; the hidden states' gradient
    within the chain's own error of float64's, on rows whose target is unlikely, likely and near certain (where a
    sum over every word including the target would lose the gradient to cancellation)."""
    generator = torch.Generator().manual_seed(3)
    vocab, width = 300, 48
    weight = (torch.randn(vocab, width, generator=generator) * 0.3).to(dtype)
    hidden = torch.randn(6, width, generator=generator)
    targets = torch.tensor([5, 17, 250, 3, 99, 299])
    hidden[3] += 1.5 * weight[targets[3]].float()  # a likely target
    hidden[4:] += 7.0 * weight[targets[4:]].float()  # near certain ones: 1 - p about 1e-5 and 5e-7
    hidden = hidden.to(dtype)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.0, -1.0])

    def gradient(function, x):
        x = x.clone().requires_grad_()
        out = function(x)
        (out.double() * weights.double()).sum().backward()
        return out.detach(), x.grad.double()

    chain, chain_grad = gradient(lambda x: ops.log_softmax_at(ops.linear(x, weight, None, torch.float32), targets),
                                 hidden)
    mine, mine_grad = gradient(lambda x: ops.frozen_head_logprobs(x, weight, targets), hidden)
    _, exact = gradient(lambda x: torch.log_softmax(x @ weight.double().T, -1).gather(-1, targets[:, None])[:, 0],
                        hidden.double())
    assert torch.equal(mine, chain)
    assert chain[4:].exp().min() > 1 - 1e-4
    for row in range(6):
        scale = exact[row].abs().max().item()
        allowed = max(2 * (chain_grad[row] - exact[row]).abs().max().item(), 1e-6 * scale)
        assert (mine_grad[row] - exact[row]).abs().max().item() <= allowed, row


def test_a_trained_output_layer_is_refused_by_the_frozen_path():
    weight = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match="trained"):
        ops.frozen_head_logprobs(torch.randn(2, 4), weight, torch.tensor([1, 2]))


def _chained_log_softmax_at(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The composed chain ``ops.log_softmax_at`` differentiated before its backward was one kernel."""
    return logits.gather(-1, targets[:, None]).squeeze(-1) - ops.row_logsumexp(logits)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 70), spread=st.sampled_from([0.1, 3.0, 30.0]),
       masked=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_the_logprobs_gradient_in_one_pass_has_the_chains_bits(rows, vocab, spread, masked, threads, seed):
    """``ops.log_softmax_at``'s gradient (one pass, cpu.log_softmax_at_grad) against the composed chain's autograd:
    any vocabulary width (a tail of fewer than 16 columns), flat and peaked rows, logits of -inf (a filtered token),
    gradients of either sign and 0, 1-3 threads: equal bit for bit, and so are the logprobs."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * spread
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    if masked and vocab > 1:
        off = torch.rand(rows, vocab, generator=generator) < 0.3
        off[torch.arange(rows), targets] = False
        logits = logits.masked_fill(off, float("-inf"))
    grad = torch.randn(rows, generator=generator)
    grad[0] = 0.0
    mine_in, chain_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mine = ops.log_softmax_at(mine_in, targets)
        (mine_grad,) = torch.autograd.grad(mine, mine_in, grad)
        chain = _chained_log_softmax_at(chain_in, targets)
        (chain_grad,) = torch.autograd.grad(chain, chain_in, grad)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(mine, chain)
    assert torch.equal(mine_grad.view(torch.int32), chain_grad.view(torch.int32)), (mine_grad - chain_grad).abs().max()


def test_the_logprobs_gradient_refuses_a_target_outside_the_vocabulary():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="outside the 5 columns"):
        cpu.log_softmax_at_grad(logits, torch.zeros(2), torch.tensor([0, 5]), torch.ones(2))
