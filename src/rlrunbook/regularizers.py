"""Regularizers and diagnostics of a policy-gradient step, as pure functions of tensors.

Everything here is token-wise over flat ``(N,)`` tensors of trained positions, like :mod:`rlrunbook.losses`:
``lp`` are the policy's logprobs of the target tokens (with grad), ``ref`` a reference policy's logprobs of
the same tokens (no grad) and ``q`` the sampler's. The trainer sums the per-token values (the token-SUM
convention of the losses), so a regularizer's weight means the same thing in one call or split over many.

- KL to a reference, estimated from the sampled tokens (Schulman, "Approximating KL Divergence", 2020):
  ``k1 = lp - ref`` (unbiased, can be negative), ``k3 = exp(ref - lp) - (ref - lp) - 1`` (unbiased for
  KL(policy || ref) under samples of the policy, always >= 0), ``low_var_kl`` = k3 clamped to [-10, 10]
  (verl's name for it). Looked up by name once, with :func:`get_kl_estimator`.
  k3 is computed as ``expm1(x) - x``, never as ``exp(x) - x - 1``: for |x| near 1e-9 ``exp(x)`` rounds to
  1 + one ulp or so, and subtracting 1 leaves that rounding error, which makes the estimate -1.1e-16 in
  float64 and, in float32, negative for ~2% of tokens with |x| <= 1e-3. ``expm1`` keeps full relative
  precision near 0, and ``fl(expm1(x)) >= x`` because the true value exceeds the representable ``x``.
- Token entropy of the policy, ``H = -sum_v p_v log p_v``, from logits rows.
- Sampler-trainer mismatch on the same tokens: mean ``|lp - q|`` and k3 of KL(sampler || trainer).
- Clip fraction: the share of tokens whose ratio ``exp(lp - q)`` lies outside ``[low, high]``.

:class:`RegularizerConfig` and :func:`split_regularizer_config` parse the local backend's extension keys of
``loss_fn_config`` (``kl_coef``, ``kl_estimator``, ``entropy_coef``); the hosted Tinker service does not
know them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from rlrunbook.errors import ConfigError

KlEstimator = Callable[[Tensor, Tensor], Tensor]  # (lp (N,), ref (N,)) -> per-token estimate (N,)

# exp(88.7) overflows float32. Beyond |log ratio| = 20, k3 > e^20 - 21 is far past low_var_kl's clamp of 10,
# so bounding the log ratio there changes no clamped value and keeps exp's backward finite (0 * inf = nan).
_LOG_RATIO_BOUND = 20.0
_LOW_VAR_KL_BOUND = 10.0


def kl_k1(lp: Tensor, ref: Tensor) -> Tensor:
    """``k1 = lp - ref``: the plain log ratio; unbiased for KL(policy || ref), high variance, can be < 0."""
    return lp - ref


def kl_k3(lp: Tensor, ref: Tensor) -> Tensor:
    """``k3 = exp(ref - lp) - (ref - lp) - 1``: unbiased for KL(policy || ref), never negative.

    With ``x = ref - lp`` the estimate is ``e^x - x - 1 >= 0`` (the tangent of ``e^x`` at 0 lies below it).
    """
    return _k3_of_log_ratio(ref - lp)  # (N,)


def _k3_of_log_ratio(x: Tensor) -> Tensor:
    """``e^x - x - 1`` as ``expm1(x) - x``, which stays >= 0 in floating point (see the module docstring)."""
    return torch.expm1(x) - x


def kl_low_var(lp: Tensor, ref: Tensor) -> Tensor:
    """k3 clamped to ``[-10, 10]`` (verl's ``low_var_kl``); a token far off the reference stops pulling."""
    log_ratio = (ref - lp).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # (N,) see _LOG_RATIO_BOUND
    return _k3_of_log_ratio(log_ratio).clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)


KL_ESTIMATORS: Mapping[str, KlEstimator] = MappingProxyType({
    "k1": kl_k1,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
})


def get_kl_estimator(name: str) -> KlEstimator:
    """The KL estimator called ``name``; ``ConfigError`` naming the valid ones otherwise."""
    estimator = KL_ESTIMATORS.get(name) if isinstance(name, str) else None
    if estimator is None:
        valid = ", ".join(sorted(KL_ESTIMATORS))
        raise ConfigError(f"unknown kl_estimator {name!r}; pass one of: {valid}.")
    return estimator


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy ``H = -sum_v softmax(z)_v * log_softmax(z)_v`` of each row of finite ``logits``, in float32.

    ``logits``: ``(..., V)`` -> ``(...)``; differentiable. Uniform rows give ``log V``, a one-hot-like row ~0.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)  # (..., V)
    return -(log_p.exp() * log_p).sum(dim=-1)


@dataclass(frozen=True)
class Mismatch:
    """How far the trainer's logprobs ``lp`` are from the sampler's ``q`` on the same tokens (detached)."""

    abs_logprob_diff: Tensor  # () mean |lp - q|
    kl: Tensor  # () mean k3 estimate of KL(sampler || trainer)


def sampler_mismatch(lp: Tensor, q: Tensor) -> Mismatch:
    """Mean ``|lp - q|`` and the k3 estimate of KL(sampler || trainer) from tokens the sampler drew.

    With ``d = lp - q`` the ratio ``p/q = e^d`` has mean 1 under ``q``, so ``e^d - d - 1`` is an unbiased,
    non-negative estimate of ``E_q[-d] = KL(q || p)``, computed as ``expm1(d) - d`` (see the module docstring:
    the other form came out negative for ~2% of float32 tokens with |d| <= 1e-3). Both are 0 exactly when
    ``lp == q``.
    """
    d = (lp - q).detach().float()  # (N,)
    return Mismatch(abs_logprob_diff=d.abs().mean(), kl=_k3_of_log_ratio(d).mean())


def clip_fraction(lp: Tensor, q: Tensor, low: float, high: float) -> Tensor:
    """Share of tokens whose ratio ``exp(lp - q)`` lies outside ``[low, high]`` (a detached scalar)."""
    ratio = torch.exp((lp - q).detach())  # (N,)
    return ((ratio < low) | (ratio > high)).float().mean()


@dataclass(frozen=True)
class RegularizerConfig:
    """The local backend's extension of ``loss_fn_config`` (unknown to the hosted Tinker service).

    The trainer adds ``kl_coef * sum_t kl_t - entropy_coef * sum_t H_t`` to the loss, summed over the trained
    positions; a coefficient of 0 switches its term (and its extra computation) off.
    """

    kl_coef: float = 0.0
    """Weight of the summed per-token KL to the reference (the base model: the adapter disabled)."""
    kl_estimator: str = "low_var_kl"
    """Per-token KL estimator: ``k1``, ``k3`` or ``low_var_kl`` (see :data:`KL_ESTIMATORS`)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: ``entropy_coef * sum_t H_t`` is subtracted from the loss."""

    def __post_init__(self) -> None:
        for key in ("kl_coef", "entropy_coef"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ConfigError(
                    f"loss_fn_config[{key!r}] = {value!r} must be a finite number >= 0 "
                    f"(0 switches the term off); pass e.g. {{{key!r}: 0.01}}."
                )
        get_kl_estimator(self.kl_estimator)

    @property
    def estimator(self) -> KlEstimator:
        return get_kl_estimator(self.kl_estimator)


REGULARIZER_KEYS = ("kl_coef", "kl_estimator", "entropy_coef")


def split_regularizer_config(
    config: Mapping[str, float | str] | None,
) -> tuple[RegularizerConfig, dict[str, float | str]]:
    """Separate the regularizer keys from a ``loss_fn_config``; the rest is the loss's own config.

    ``ConfigError`` for a negative or non-numeric coefficient or an unknown estimator.
    """
    config = dict(config or {})
    own = {key: config.pop(key) for key in REGULARIZER_KEYS if key in config}
    for key in ("kl_coef", "entropy_coef"):
        if key in own and isinstance(own[key], str):
            try:
                own[key] = float(own[key])
            except ValueError:
                pass  # RegularizerConfig names the bad value
    return RegularizerConfig(**own), config


@dataclass(frozen=True)
class Correction:
    """Per-token weights that correct a sampler-trainer mismatch, and the share of tokens they changed."""

    weights: Tensor  # (N,) detached, >= 0
    corrected_fraction: Tensor  # () share of tokens capped (truncate) or masked (mask)


def importance_correction(log_ratio: Tensor, mode: str, cap: float = 2.0, low: float = 0.125,
                          high: float = 8.0) -> Correction:
    """Weights for tokens drawn by a sampler ``q`` and scored by the trainer as ``p``: ``log_ratio = log p - log q``.

    ``truncate``: truncated importance sampling, ``w = min(p / q, cap)`` (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"; verl's and SkyRL's default cap
    2); a token is *corrected* when the cap binds. ``mask``: ``w = 1`` where ``low <= p / q <= high``,
    else 0 (prime-rl's token mask, [1/8, 8]); a token is corrected when masked. ``none``: all ones.
    Both sides must be the same distribution (the sampler's, with its temperature and filters).
    """
    ratio = torch.exp(log_ratio.detach().float())  # (N,)
    if mode == "none":
        return Correction(torch.ones_like(ratio), ratio.new_zeros(()))
    if mode == "truncate":
        capped = ratio > cap
        return Correction(ratio.clamp(max=cap), capped.float().mean() if ratio.numel() else ratio.new_zeros(()))
    if mode == "mask":
        kept = (ratio >= low) & (ratio <= high)
        return Correction(kept.float(), (~kept).float().mean() if ratio.numel() else ratio.new_zeros(()))
    raise ConfigError(f"mismatch correction {mode!r} must be 'none', 'truncate' or 'mask'.")
