"""The counter-based Gumbel noise: computed in cache-sized blocks in place, bit for bit the plain formula."""

from __future__ import annotations

import pytest
import torch

from rlrunbook.engines import noise


def _plain_gumbel(row_seeds: torch.Tensor, step: int, vocab_size: int) -> torch.Tensor:
    """The definition, one whole-tensor operation after another (the engine's formula before blocking)."""
    base = noise.splitmix64(row_seeds ^ noise.splitmix64(torch.tensor(step, dtype=torch.int64)))
    index = torch.arange(vocab_size, dtype=torch.int64) * noise._GOLDEN
    bits = noise._shr(noise.splitmix64(base[:, None] + index[None, :]), 11)
    uniform = (bits.double() + 0.5) / float(1 << 53)
    return (-torch.log(-torch.log(uniform))).float()


@pytest.mark.parametrize("rows,vocab_size", [(16, 49152), (3, 1000), (5, noise._ROW_BLOCK_ELEMENTS + 1), (1, 7)])
@pytest.mark.parametrize("step", [0, 63])
def test_blocked_noise_is_the_plain_formula_bit_for_bit(rows, vocab_size, step):
    seeds = torch.tensor([noise.mix_seed(11, r) for r in range(rows)])
    assert torch.equal(noise.gumbel_noise(seeds, step, vocab_size), _plain_gumbel(seeds, step, vocab_size))


def test_a_row_s_noise_does_not_depend_on_its_batch():
    seeds = torch.tensor([noise.mix_seed(5, r) for r in range(9)])
    together = noise.gumbel_noise(seeds, 4, 3000)
    for r in range(9):
        assert torch.equal(noise.gumbel_noise(seeds[r:r + 1], 4, 3000)[0], together[r])


def test_noise_is_standard_gumbel():
    sample = noise.gumbel_noise(torch.tensor([noise.mix_seed(1, r) for r in range(64)]), 0, 4096).double()
    # Gumbel(0, 1): mean = Euler-Mascheroni 0.5772, variance pi^2 / 6 = 1.6449; 262,144 draws, 6 standard errors
    assert abs(sample.mean().item() - 0.5772) < 6 * (1.6449 / sample.numel()) ** 0.5
    assert abs(sample.var().item() - 1.6449) < 0.05


def test_mix_seed_in_python_integers_is_splitmix64_on_tensors():
    def on_tensors(*parts):  # the definition: splitmix64 of int64 tensors, part after part
        state = torch.tensor(0, dtype=torch.int64)
        for part in parts:
            state = noise.splitmix64(state ^ torch.tensor(noise._signed(part), dtype=torch.int64))
        return int(state) & ((1 << 63) - 1)

    for parts in [(), (0,), (1, 2), (-1,), (2**64 - 1, 5), (2**63, -2**63, 7), (123456789, 0, 3)]:
        assert noise.mix_seed(*parts) == on_tensors(*parts)
