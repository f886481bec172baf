"""Counter-based random numbers: the same (seed, step, token) gives the same number on any device,
in any batch.

Sampling draws token ``argmax(scores + Gumbel noise)``, which is an exact draw from
``softmax(scores)`` (the Gumbel-max trick). The noise of row ``r`` at step ``t`` is a pure
function of ``(row_seed[r], t, vocabulary index)`` through the splitmix64 mixer, so a row's
sample does not depend on which other rows share its batch: concurrent requests can be
coalesced into one generate call without changing anything a seeded caller sees.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic), elementwise."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _splitmix64_int(x: int) -> int:
    """:func:`splitmix64` of one 64-bit value in Python integers (unsigned in, unsigned out): the same bits."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """Combine integers (a request seed, a prompt index, a sample index) into one 63-bit seed: ``state = 0``, then
    ``state = splitmix64(state ^ part)`` per part (64-bit wrapping), its low 63 bits. Computed in Python integers
    (no tensor op per seed), the same bits as :func:`splitmix64` on int64 tensors."""
    state = 0
    for part in parts:
        state = _splitmix64_int(state ^ (part & _MASK64))
    return state & ((1 << 63) - 1)


_ROW_BLOCK_ELEMENTS = 1 << 17  # on CPU, noise is made a block of rows at a time: ~1 MB of int64 stays in cache
_indices: dict[tuple[int, torch.device], torch.Tensor] = {}


def _scaled_index(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``arange(V) * golden`` (int64, wrapping), made once per vocabulary size and device."""
    key = (vocab_size, device)
    index = _indices.get(key)
    if index is None:
        index = _indices[key] = torch.arange(vocab_size, dtype=torch.int64, device=device) * _GOLDEN
    return index


def _splitmix64_(z: torch.Tensor) -> torch.Tensor:
    """:func:`splitmix64` computed in place in ``z`` (the same operations, so the same bits)."""
    z.add_(_GOLDEN)
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shr(z, 31))


def gumbel_noise(row_seeds: torch.Tensor, step: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``[R, V]`` (float32) for rows with seeds ``row_seeds`` ``[R]`` at ``step``.

    Element ``(r, i)`` is ``-log(-log(u))`` with ``u = (bits + 0.5) / 2**53`` in (0, 1) and ``bits`` the top 53
    bits of ``splitmix64(base[r] + i * golden)``, computed in float64 and rounded once to float32.
    On CPU, blocks of rows (``_ROW_BLOCK_ELEMENTS`` elements) are computed in place, so each block's working
    set stays in cache; the operations per element are the same, so the bits are too.
    """
    device = row_seeds.device
    base = splitmix64(row_seeds ^ splitmix64(torch.tensor(step, dtype=torch.int64, device=device)))  # [R]
    index = _scaled_index(vocab_size, device)  # [V]
    rows = row_seeds.shape[0]
    block = rows if device.type != "cpu" else max(1, _ROW_BLOCK_ELEMENTS // max(vocab_size, 1))
    noise = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
    for start in range(0, rows, block):
        z = _splitmix64_(base[start:start + block, None] + index[None, :])
        bits = _shr(z, 11)  # 53 random bits
        uniform = bits.double().add_(0.5).div_(float(1 << 53))  # in (0, 1), never 0 or 1
        noise[start:start + block] = uniform.log_().neg_().log_().neg_()
    return noise
