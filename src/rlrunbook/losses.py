"""The Tinker API's built-in losses as pure functions of tensors, looked up by name.

Every loss is token-wise and SUMMED over the trained token positions, never averaged, exactly as the
hosted service computes it: two ``forward_backward`` calls over disjoint data then accumulate the same
gradient as one call over their union. All tensors are flat ``(N,)`` over the batch's trained positions
(the trainer concatenates the datums); ``lp`` are the learner's logprobs of the target tokens (with
grad), ``q`` the sampler's (``loss_fn_inputs["logprobs"]``), ``A`` the advantages, ``w`` the weights and
``r = exp(lp - q)`` the per-token importance ratio.

Config keys and defaults follow the Tinker docs (tinker-docs.thinkingmachines.ai/tinker/losses/*):
ppo ``clip_low_threshold=0.8, clip_high_threshold=1.2`` (the docs' "epsilon fixed to 0.2"); cispo
``0.0, 4.0`` (the docs' one-sided default: no lower bound, cap at 4); dro ``beta=0.05`` (the docs state
no default, only the example ``{"beta": 0.05}``, so that example is the default here); gspo
``0.9997, 1.0004`` (the GSPO paper's clipping ranges 3e-4 and 4e-4; the installed SDK states none).
Thresholds are absolute ratio bounds, not epsilons. The SDK also knows per-token ``clip_*_threshold``
loss inputs; this backend rejects them rather than silently ignoring them. ``sequence_ratio_mask`` is
read by ``gspo`` (the positions of the sampled sequence) and refused by every other loss.

A sequence-level loss (``LossSpec.per_sequence``) also gets ``inputs["sequence_index"]``: for each
position, the index of its datum, which the trainer supplies (a datum is one sequence).

The registry ``LOSSES`` is the only dispatch: ``get_loss(name)`` once when a request is built, then
``spec.fn(target_logprobs, inputs, config)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from rlrunbook.errors import ConfigError, InputError


@dataclass(frozen=True)
class LossOutput:
    """What a loss returns: the scalar to backpropagate and cheap diagnostics.

    ``metrics`` are named ``name:reduction`` like Tinker's (``ratio:mean``); ``loss:sum`` is added by
    the trainer, never here. ``:sum`` metrics add up across calls, ``:mean``/``:max`` are per call.
    """

    loss: Tensor  # () scalar, differentiable wrt target_logprobs
    metrics: dict[str, float]


Inputs = Mapping[str, Tensor]  # loss_fn_inputs name -> (N,) tensor
Config = Mapping[str, float]  # loss_fn_config
LossFn = Callable[[Tensor, Inputs, Config], LossOutput]


@dataclass(frozen=True)
class LossSpec:
    """One registered loss: its function, the ``loss_fn_inputs`` it reads and its config keys."""

    name: str
    fn: LossFn  # validates inputs and config, then computes; see the module docstring
    required_inputs: tuple[str, ...]  # loss_fn_inputs keys besides target_tokens (the trainer's)
    config_defaults: Mapping[str, float]  # the only loss_fn_config keys this loss accepts
    uses_advantages: bool
    citation: str
    # loss_fn_inputs read where given, else filled with this value
    optional_inputs: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    per_sequence: bool = False  # reads inputs["sequence_index"] (supplied by the trainer, not the caller)

    @property
    def doc(self) -> str:
        return self.fn.__doc__ or ""


_LOSSES: dict[str, LossSpec] = {}
LOSSES: Mapping[str, LossSpec] = MappingProxyType(_LOSSES)

# Tinker loss names (tinker.types.LossFnType) that this backend does not implement, with the nearest one.
_NOT_SUPPORTED = {
    "stable_reinforce": "the nearest supported losses are 'cispo' (bounded, detached importance weight) "
    "and 'importance_sampling'",
    "custom": "server-registered losses do not exist locally; pass the loss itself to "
    "forward_backward_custom (a callable, or a LossHandle of ServiceClient.create_custom_loss)",
}


# loss_fn_inputs the SDK knows (tinker.types.datum) that would change the maths but are not read here.
_UNREAD_INPUTS = ("clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask")


def get_loss(name: str) -> LossSpec:
    """The registered loss called ``name``; ``ConfigError`` naming the supported ones otherwise."""
    spec = _LOSSES.get(name)
    if spec is not None:
        return spec
    supported = ", ".join(sorted(_LOSSES))
    if name in _NOT_SUPPORTED:
        raise ConfigError(
            f"loss_fn {name!r} is a Tinker loss but is not supported by the local backend: "
            f"{_NOT_SUPPORTED[name]}. Supported: {supported}."
        )
    raise ConfigError(f"unknown loss_fn {name!r}; pass one of the supported losses: {supported}.")


def resolve_loss_config(spec: LossSpec, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """``spec``'s defaults overridden by ``config``; ``ConfigError`` on unknown keys or non-finite values."""
    config = config or {}
    unknown = sorted(set(config) - set(spec.config_defaults))
    if unknown:
        allowed = ", ".join(sorted(spec.config_defaults)) or "none"
        raise ConfigError(
            f"loss_fn_config keys {unknown} are not used by loss {spec.name!r}; allowed keys: {allowed}. "
            "Remove them or pick the loss they belong to."
        )
    resolved = dict(spec.config_defaults)
    for key, value in config.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise ConfigError(
                f"loss_fn_config[{key!r}] = {value!r} for loss {spec.name!r} is not a finite number."
            )
        resolved[key] = number
    return resolved


def validate_loss_inputs(spec: LossSpec, inputs: Inputs, *, num_tokens: int | None = None) -> None:
    """Raise ``InputError`` unless every required input is present and all inputs are 1-D of one length.

    ``num_tokens`` (the length of ``target_logprobs``) is checked too when given; zero positions is an error.
    """
    missing = [key for key in spec.required_inputs if key not in inputs]
    if missing:
        raise InputError(
            f"loss {spec.name!r} needs loss_fn_inputs {list(spec.required_inputs)}; missing {missing}. "
            f"Got {sorted(inputs)}."
        )
    unread = sorted(set(inputs) & set(_UNREAD_INPUTS) - set(spec.optional_inputs))
    if unread:
        raise InputError(
            f"loss_fn_inputs {unread} are not read by loss {spec.name!r} on the local backend (per-token clip "
            "thresholds are not supported: set them once in loss_fn_config; sequence_ratio_mask belongs to "
            "'gspo'). Remove them or pick the loss they belong to."
        )
    lengths = {"target_logprobs": num_tokens} if num_tokens is not None else {}
    for key, value in inputs.items():
        if not isinstance(value, Tensor) or value.dim() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise InputError(
                f"loss_fn_inputs[{key!r}] must be a flat 1-D tensor over token positions, got {shape}."
            )
        lengths[key] = value.shape[0]
    if len(set(lengths.values())) > 1:
        raise InputError(f"loss {spec.name!r}: inputs cover different numbers of token positions: {lengths}.")
    if 0 in lengths.values():
        raise InputError(f"loss {spec.name!r}: no token positions to train on ({lengths}).")


def _register(name: str, required: tuple[str, ...], defaults: Mapping[str, float], citation: str, *,
              optional: Mapping[str, float] | None = None, per_sequence: bool = False):
    """Register ``kernel`` (pure maths on a resolved config) behind a validating ``LossFn``."""

    def wrap(kernel: LossFn) -> LossFn:
        @functools.wraps(kernel)
        def fn(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
            if target_logprobs.dim() != 1:
                shape = tuple(target_logprobs.shape)
                raise InputError(f"target_logprobs must be 1-D (N,), got shape {shape}.")
            validate_loss_inputs(spec, inputs, num_tokens=target_logprobs.shape[0])
            return kernel(target_logprobs, inputs, resolve_loss_config(spec, config))

        frozen_defaults = MappingProxyType(dict(defaults))
        spec = LossSpec(name, fn, required, frozen_defaults, "advantages" in required, citation,
                        MappingProxyType(dict(optional or {})), per_sequence)
        _LOSSES[name] = spec
        return fn

    return wrap


def _clip_bounds(name: str, cfg: Mapping[str, float]) -> tuple[float, float]:
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ConfigError(
            f"loss {name!r} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {lo} and {hi}; "
            "the thresholds are absolute ratio bounds (e.g. 0.8 and 1.2), not epsilons."
        )
    return lo, hi


def _metrics(stats: Mapping[str, Tensor]) -> dict[str, float]:
    # One host sync for all of a call's diagnostics.
    values = torch.stack([s.detach().float() for s in stats.values()]).tolist()
    return dict(zip(stats, values, strict=True))


_RL_INPUTS = ("logprobs", "advantages")
_PPO_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # Tinker: eps fixed to 0.2
_CISPO_DEFAULTS = {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}  # Tinker docs: one-sided
_GSPO_DEFAULTS = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}  # GSPO paper, section 5.1


@_register("cross_entropy", ("weights",), {}, "Tinker docs, losses/cross_entropy: weighted NLL")
def cross_entropy(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
    """Weighted negative log-likelihood: ``loss = -sum_t w_t * lp_t`` (Tinker ``cross_entropy``).

    Weights are usually 0 on prompt and 1 on completion positions; no normalisation by their sum.
    """
    lp, w = target_logprobs, inputs["weights"]  # (N,), (N,)
    loss = -(lp * w).sum()  # ()
    return LossOutput(loss, _metrics({"weights:sum": w.sum(), "weighted_tokens:sum": (w != 0).sum()}))


@_register("importance_sampling", _RL_INPUTS, {}, "Tinker docs, losses/importance_sampling")
def importance_sampling(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
    """Policy gradient with importance weights (Tinker docs): ``loss = -sum_t r_t * A_t``.

    ``d loss / d lp_t = -r_t * A_t``: REINFORCE, reweighted by ``p_theta / q`` for the sampler mismatch.
    The ratio is unbounded; ``ppo`` or ``cispo`` bound it.
    """
    lp, q, adv = target_logprobs, inputs["logprobs"], inputs["advantages"]  # (N,) each
    ratio = torch.exp(lp - q)  # (N,)
    loss = -(ratio * adv).sum()  # ()
    return LossOutput(loss, _metrics({"ratio:mean": ratio.mean(), "ratio:max": ratio.max()}))


@_register("ppo", _RL_INPUTS, _PPO_DEFAULTS, "Schulman et al. 2017, eq. 7")
def ppo(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
    """PPO's clipped surrogate, Schulman et al. 2017 "Proximal Policy Optimization Algorithms", eq. 7.

    ``loss = -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)``, token-wise and summed (the paper averages).
    Departures from the paper, as in Tinker: asymmetric absolute bounds ``lo``/``hi`` (defaults 0.8, 1.2,
    Tinker's fixed epsilon 0.2) instead of ``1 -/+ eps``, and the ratio is against the *sampler*
    logprobs ``q``. Where the clipped branch binds the token's gradient is zero.
    ``clip_fraction:mean`` is the share of tokens with ``r`` outside ``[lo, hi]``.
    """
    lo, hi = _clip_bounds("ppo", config)
    lp, q, adv = target_logprobs, inputs["logprobs"], inputs["advantages"]  # (N,) each
    ratio = torch.exp(lp - q)  # (N,)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)  # (N,)
    loss = -surrogate.sum()  # ()
    clipped = (ratio < lo) | (ratio > hi)  # (N,) bool
    stats = {"ratio:mean": ratio.mean(), "clip_fraction:mean": clipped.float().mean()}
    return LossOutput(loss, _metrics(stats))


@_register("cispo", _RL_INPUTS, _CISPO_DEFAULTS, "MiniMax-M1, 2025 (CISPO)")
def cispo(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
    """CISPO, MiniMax "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", 2025.

    ``loss = -sum_t sg(clip(r_t, lo, hi)) * lp_t * A_t``: the clipped ratio is a detached coefficient,
    so every token keeps a gradient ``-clip(r_t) A_t`` (PPO would zero it). Defaults follow the Tinker
    docs' one-sided clip ``lo=0, hi=4`` (MiniMax-M1 tunes only the upper bound). Token sum, not mean.
    """
    lo, hi = _clip_bounds("cispo", config)
    lp, q, adv = target_logprobs, inputs["logprobs"], inputs["advantages"]  # (N,) each
    ratio = torch.exp(lp - q).detach()  # (N,) no gradient through the coefficient
    loss = -(ratio.clamp(lo, hi) * lp * adv).sum()  # ()
    clipped = (ratio < lo) | (ratio > hi)  # (N,) bool
    stats = {"ratio:mean": ratio.mean(), "clip_fraction:mean": clipped.float().mean()}
    return LossOutput(loss, _metrics(stats))


@_register("dro", _RL_INPUTS, {"beta": 0.05}, "Richemond et al. 2024, Offline Regularised RL for LLMs")
def dro(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
    """DRO, Richemond et al. 2024 "Offline Regularised Reinforcement Learning for LLM Alignment".

    ``loss = -sum_t (lp_t A_t - beta/2 (lp_t - q_t)^2)``: the quadratic penalty keeps the learner near
    the sampler, so off-policy and offline data are usable. The advantage is the paper's soft estimate
    and is computed by the caller. ``beta`` defaults to 0.05, the value of the Tinker docs' example
    (they state no default). ``penalty:sum`` is the summed ``beta/2 (lp - q)^2`` term.
    """
    beta = config["beta"]
    if beta < 0:
        raise ConfigError(f"loss 'dro' needs beta >= 0 (a penalty weight), got {beta}.")
    lp, q, adv = target_logprobs, inputs["logprobs"], inputs["advantages"]  # (N,) each
    penalty = 0.5 * beta * (lp - q) ** 2  # (N,)
    loss = -(lp * adv - penalty).sum()  # ()
    ratio = torch.exp(lp - q)  # (N,)
    return LossOutput(loss, _metrics({"ratio:mean": ratio.mean(), "penalty:sum": penalty.sum()}))


@_register("gspo", _RL_INPUTS, _GSPO_DEFAULTS, "Zheng et al. 2025, GSPO, arXiv 2507.18071, eqs. 5-7 and 12",
           optional={"sequence_ratio_mask": 1.0}, per_sequence=True)
def gspo(target_logprobs: Tensor, inputs: Inputs, config: Config) -> LossOutput:
    """GSPO, Zheng et al. 2025 "Group Sequence Policy Optimization": one clipped ratio per sequence.

    For sequence ``i`` with ratio positions ``M_i`` (``sequence_ratio_mask`` != 0; all its positions if
    the mask is absent), the length-normalised ratio is the geometric mean of the token ratios,
    ``s_i = exp(mean_{t in M_i} (lp_t - q_t))`` (eq. 7), and it is clipped per sequence:
    ``loss = -sum_i sum_{t in M_i} min(s_it A_t, clip(s_it, lo, hi) A_t)`` with the GSPO-token ratio
    ``s_it = sg(s_i) * exp(lp_t - sg(lp_t))`` (eq. 12): equal in value to ``s_i``, with gradient
    ``s_i * d lp_t``. With one advantage per sequence (GRPO's), its gradient is ``|M_i|`` times the
    paper's sequence objective's (eq. 5): the paper averages over tokens and sequences, this backend
    sums over tokens as for every loss. Where the clip binds, the whole sequence gets no gradient.
    Positions outside the mask neither enter the ratio nor the loss. Defaults ``lo = 1 - 3e-4``,
    ``hi = 1 + 4e-4`` are the paper's. ``ratio:mean`` averages ``s_i`` over sequences;
    ``clip_fraction:mean`` is the share of the masked positions whose sequence was clipped.
    """
    lo, hi = _clip_bounds("gspo", config)
    if "sequence_index" not in inputs:
        raise InputError("loss 'gspo' needs inputs['sequence_index'] (each position's datum), which the "
                         "trainer supplies; call it through forward_backward.")
    lp, q, adv = target_logprobs, inputs["logprobs"], inputs["advantages"]  # (N,) each
    seq = inputs["sequence_index"].long()  # (N,) datum of each position
    in_ratio = inputs.get("sequence_ratio_mask", torch.ones_like(lp)) != 0  # (N,) bool
    num_seqs = int(seq.max()) + 1
    weight = in_ratio.to(lp.dtype)  # (N,)
    counts = torch.zeros(num_seqs, dtype=lp.dtype, device=lp.device).index_add_(0, seq, weight)  # (S,)
    log_gap = torch.zeros_like(counts).index_add_(0, seq, (lp - q).detach() * weight)  # (S,)
    seq_ratio = torch.exp(log_gap / counts.clamp(min=1))  # (S,) detached s_i; 1 where no position counts
    ratio = seq_ratio[seq] * torch.exp(lp - lp.detach())  # (N,) value s_i, gradient s_i * d lp
    surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)  # (N,)
    loss = -(surrogate * weight).sum()  # ()
    has_positions = counts > 0  # (S,)
    clipped = ((seq_ratio < lo) | (seq_ratio > hi))[seq] & in_ratio  # (N,)
    mean_ratio = seq_ratio[has_positions].mean() if bool(has_positions.any()) else seq_ratio.new_ones(())
    stats = {"ratio:mean": mean_ratio,
             "clip_fraction:mean": clipped.sum() / in_ratio.sum().clamp(min=1)}
    return LossOutput(loss, _metrics(stats))
