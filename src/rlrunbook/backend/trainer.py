"""The trainer behind the local TrainingClient: forward, forward_backward, optim_step.

Semantics kept from the Tinker API: losses are token sums; gradients accumulate across
``forward_backward`` calls until ``optim_step``; each call returns the learner's logprobs of
every target token per datum and metrics named ``name:reduction`` (``loss:sum`` always).
A batch is split into micro-batches of at most ``micro_batch_tokens`` distinct tokens (and at least
``grad_accum_chunks`` of them), each with its own forward and backward, which bounds peak memory whatever the
batch and, the loss being a sum, leaves the gradient unchanged (up to the order of floating-point additions);
with ``recompute_layers`` each decoder layer keeps only its input for backward (activation checkpointing). See
:mod:`rlrunbook.backend.micro_batches` and :mod:`rlrunbook.backend.memory`.

LOCAL EXTENSION (the hosted Tinker service does not know these ``loss_fn_config`` keys): ``kl_coef``,
``kl_estimator`` and ``entropy_coef`` add ``kl_coef * sum_t kl_t - entropy_coef * sum_t H_t`` to the loss,
summed over the trained positions (see :mod:`rlrunbook.regularizers`). The KL reference is the base model:
for LoRA this same model with the adapter disabled (no second copy of the weights); for full-parameter
training a frozen copy of the initial weights in the compute dtype, sharded like the policy.

What trains: a LoRA adapter (the default), or, with ``full_parameters``, every weight of a model sharded by
:func:`rlrunbook.backend.sharding.shard` (FSDP2; one rank for a plain process). Under torchrun a sharded
model's passes are collectives: every rank runs as many micro-batch passes as the rank with the most (the
others add passes over two padding tokens that contribute nothing), and its gradients arrive summed over
ranks. Its training state is the full weights and the optimizer state keyed by parameter name
(:func:`rlrunbook.backend.sharding.full_state`): the same at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tinker import types

from rlrunbook import distributed
from rlrunbook.adam_params import check_adam_params
from rlrunbook.backend import sharding
from rlrunbook.backend.chunk_scores import ChunkScores, ChunkScoring, PaddedScoring, SharedPrefixScoring
from rlrunbook.backend.datum_items import TrainingItem, datum_item
from rlrunbook.backend.lora import adapter_parameters
from rlrunbook.backend.memory import TokenCost, needs_recompute
from rlrunbook.backend.micro_batches import micro_batches
from rlrunbook.backend.mismatch import MismatchConfig, split_mismatch_config
from rlrunbook.engines.decoder import Numerics, unsupported_reason
from rlrunbook.errors import ConfigError, InputError, NoLearningSignalError, RlrunbookError
from rlrunbook.losses import LossSpec, get_loss, resolve_loss_config
from rlrunbook.metrics import merge_reduced
from rlrunbook.regularizers import (
    RegularizerConfig,
    clip_fraction,
    importance_correction,
    sampler_mismatch,
    split_regularizer_config,
)


class NonFiniteGradientError(RlrunbookError, FloatingPointError):
    """The accumulated gradient has a NaN or inf norm; the step was refused and weights are untouched."""


@dataclass(frozen=True)
class TrainingState:
    """Everything an optimizer step depends on, copied to CPU: what an exact resume restores.

    ``adapter`` maps each trainable parameter's name (``named_parameters`` order) to its values (for
    full-parameter training: every weight, gathered); ``optimizer`` is AdamW's ``state_dict()`` (tensors and
    plain numbers only; keyed by parameter name for full-parameter training), None before the first step;
    ``weights_version`` is informational (sampler snapshots key on it, training does not). ``shard`` = (rank, world):
    ``adapter`` and ``optimizer`` hold that rank's shards of a full-parameter state sharded over ``world`` ranks
    (``sharding.local_state``), not whole tensors.
    """

    adapter: dict[str, torch.Tensor]
    optimizer: dict | None
    weights_version: int
    shard: tuple[int, int] | None = None


def _trained_positions(item: TrainingItem, spec: LossSpec) -> int:
    key = "advantages" if spec.uses_advantages else "weights"
    return int(((item.inputs[key] != 0) & item.mask).sum())


@dataclass(frozen=True)
class _ChunkOutput:
    """What one gradient-accumulation chunk contributes: loss (with graph), per-datum logprobs, metrics."""

    loss: torch.Tensor  # () the total: the loss's own plus the regularizer terms
    logprobs: list[torch.Tensor]
    metrics: dict[str, float]
    positions: int  # tokens the loss saw: the weight of this chunk's ``:mean`` metrics
    weights: dict[str, int] = field(default_factory=dict)  # per-metric weights where they differ
    sampling_logprobs: list[torch.Tensor] = field(default_factory=list)  # per datum, NaN off the loss positions


# ``:mean`` metrics over the regularized positions (a subset of the loss's for cross_entropy).
_REGULARIZED_MEANS = ("kl_divergence:mean", "entropy:mean")
_DEFAULT_RATIO_BOUNDS = (0.8, 1.2)  # PPO's epsilon 0.2, for clip_fraction of losses without clip bounds


def _sampler_terms(lp: torch.Tensor, inputs: dict[str, torch.Tensor], sampling_lp: torch.Tensor,
                   mismatch: MismatchConfig, config: Mapping[str, float], *,
                   token_clip_fraction: bool = True) -> dict[str, torch.Tensor]:
    """Measure the sampler-trainer mismatch on the loss's positions and, if asked, correct for it.

    The mismatch compares like with like: ``sampling_lp``, the trainer's logprobs under the sampler's
    transform (``logits / T`` and filters), against the sampler's ``q``, before this call's update.
    With a correction, ``inputs`` is changed in place: the loss reads the trainer's own T = 1 logprobs
    as its behaviour policy and every token's advantage is scaled by its importance weight
    (see :mod:`rlrunbook.backend.mismatch`). The clip fraction is then measured on the ratio the loss
    uses, between the loss's clip bounds (ppo, cispo) or else ``[0.8, 1.2]``; a sequence-level loss
    (gspo) reports its own clip fraction instead (``token_clip_fraction=False``).
    """
    q = inputs["logprobs"]
    gap = sampler_mismatch(sampling_lp, q)
    stats = {"mismatch/abs_logprob_diff:mean": gap.abs_logprob_diff, "mismatch/kl:mean": gap.kl}
    if mismatch.correction != "none":
        correction = importance_correction(sampling_lp - q, mismatch.correction, mismatch.cap, mismatch.mask_low,
                                           mismatch.mask_high)
        inputs["logprobs"] = lp.detach()
        inputs["advantages"] = inputs["advantages"] * correction.weights
        stats["mismatch/corrected_fraction:mean"] = correction.corrected_fraction
    if not token_clip_fraction:
        return stats
    low = config.get("clip_low_threshold", _DEFAULT_RATIO_BOUNDS[0])
    high = config.get("clip_high_threshold", _DEFAULT_RATIO_BOUNDS[1])
    stats["clip_fraction:mean"] = clip_fraction(lp, inputs["logprobs"], low, high)
    return stats


def _regularizer_terms(scores: ChunkScores, where: torch.Tensor,
                       reg: RegularizerConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """``kl_coef * sum kl - entropy_coef * sum H`` over the loss positions ``where`` (bool ``(N,)``), its parts
    as metrics, and the count. The KL reads the reference logprobs, the entropy the policy's (both in ``scores``)."""
    lp = scores.seen_logprobs
    n = int(where.sum())
    kl_loss = entropy_loss = lp.new_zeros(())
    stats: dict[str, torch.Tensor] = {}
    if scores.seen_reference is not None and n > 0:
        kl = reg.estimator(lp[where], scores.seen_reference[where])  # (n,)
        kl_loss = reg.kl_coef * kl.sum()
        stats["kl_divergence:mean"] = kl.mean()
    if scores.seen_entropy is not None and n > 0:
        entropy = scores.seen_entropy[where]  # (n,)
        entropy_loss = -reg.entropy_coef * entropy.sum()
        stats["entropy:mean"] = entropy.mean()
    stats.update({"loss_kl:sum": kl_loss, "loss_entropy:sum": entropy_loss})
    return kl_loss + entropy_loss, stats, n


def _per_datum(chunk: list[TrainingItem], seen_values: torch.Tensor) -> list[torch.Tensor]:
    """Flat values over the loss positions, spread back to one ``[L]`` tensor per datum (NaN elsewhere)."""
    values = seen_values.detach().float().cpu()
    out, cursor = [], 0
    for item in chunk:
        row = torch.full((len(item.input_tokens),), float("nan"))
        count = int(item.mask.sum())
        row[item.mask] = values[cursor:cursor + count]
        cursor += count
        out.append(row)
    return out


def _merge_metrics(parts: list[_ChunkOutput]) -> dict[str, float]:
    """Merge chunk metrics by reduction suffix; a ``:mean`` is weighted by the positions it averaged over."""
    return merge_reduced([p.metrics for p in parts],
                         [{key: p.weights.get(key, p.positions) for key in p.metrics} for p in parts])


class Trainer:
    """Owns the trained model (LoRA-wrapped, or sharded for full-parameter training) and its optimizer; every
    method runs on the backend's worker thread."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, vocab_size: int, grad_accum_chunks: int = 1,
                 accept_zero_advantages: bool = False, numerics: Numerics | str = "invariant",
                 micro_batch_tokens: int | None = None, recompute_layers: bool = False,
                 full_parameters: bool = False, reference: torch.nn.Module | None = None,
                 plain_cost: TokenCost | None = None, kept_source: object = None):
        self.model = model
        self.full_parameters = full_parameters  # every weight trains (the model sharded by backend/sharding.py)
        if full_parameters and (not sharding.is_sharded(model) or unsupported_reason(model) is not None):
            raise ConfigError("full-parameter training needs a model the in-process decoder runs (Llama, Qwen2, "
                              "Qwen3, Mistral families), sharded first (backend.sharding.shard).")
        # The sampler's own forward (shared prefixes, logits only where needed) where it covers the model;
        # otherwise transformers' forward over padded datums.
        # kept_source: the sampling engine, whose kept projection outputs (engines/kept_products.py) are read where
        # they apply, and dropped when the weights move.
        self.scoring: ChunkScoring = (SharedPrefixScoring(model, numerics, recompute_layers, reference, kept_source)
                                      if unsupported_reason(model) is None else PaddedScoring(model, pad_token_id))
        self.micro_batch_tokens = micro_batch_tokens
        self.recompute_layers = recompute_layers
        # With recompute_layers: a micro-batch whose cost without checkpointing fits in the memory free when it
        # runs skips it (memory.needs_recompute; same values either way). Not for a sharded model: every rank
        # must run the same collectives, and free memory differs between ranks.
        self.plain_cost = None if full_parameters else plain_cost
        self.recomputed_passes = 0  # passes run with checkpointing, of the last forward_backward (a metric)
        # False (the project's default): a batch with no non-zero advantage raises NoLearningSignalError.
        # True: it is computed as the hosted service computes it, loss and gradient 0 (for unmodified recipes).
        self.accept_zero_advantages = accept_zero_advantages
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.max_context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.grad_accum_chunks = grad_accum_chunks
        self.weights_version = 0  # bumped by every optimizer step or load; sampler snapshots record it
        self._optimizer: torch.optim.AdamW | None = None
        self._has_gradients = False
        self._pending_loss = 0.0  # summed loss of the forward_backward calls the next step applies
        # Full-parameter training: the weights gathered for sampling from here to the first training pass, and
        # again after every optimizer step (sampling then needs no collective, whatever rank samples).
        sharding.gather(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def collective_passes(self) -> bool:
        """Whether every rank must make every ``forward``/``forward_backward`` call (a sharded model under
        torchrun: its passes are collectives); a rank with no data then calls with an empty batch."""
        return self.full_parameters and distributed.world_size() > 1

    def trained_parameters(self) -> dict[str, torch.nn.Parameter]:
        """What the optimizer steps, by name, in its order: the adapter's, or every weight (shards under torchrun)."""
        if self.full_parameters:
            return sharding.sharded_parameters(self.model)
        return adapter_parameters(self.model)

    def forward(self, data: Sequence[types.Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float | str] | None = None) -> types.ForwardBackwardOutput:
        """Loss, logprobs and metrics as ``forward_backward`` gives them (same loss_fn_config), no grad."""
        with torch.no_grad():
            output = self._run(data, loss_fn, loss_fn_config, backward=False)
        if not self._has_gradients:  # full-parameter training: back in place for sampling (see optim_step)
            sharding.gather(self.model)
        return output

    def forward_backward(self, data: Sequence[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float | str] | None = None) -> types.ForwardBackwardOutput:
        """Loss, logprobs, and gradients added to those already accumulated.

        ``loss_fn_config`` holds the loss's own keys and, as a LOCAL EXTENSION unknown to the hosted
        service, ``kl_coef`` (default 0: off), ``kl_estimator`` (``k1`` | ``k3`` | ``low_var_kl``, the
        default) and ``entropy_coef`` (default 0: off); a negative coefficient or an unknown estimator is
        a ``ConfigError`` before anything is computed. The optimised total is
        ``loss_pg + kl_coef * sum_t kl_t - entropy_coef * sum_t H_t`` over the trained positions, where
        ``kl_t`` compares the policy with the base model (the adapter disabled, no gradient).

        Metrics besides the loss's own: ``loss:sum`` (the total) = ``loss_pg:sum`` + ``loss_kl:sum`` +
        ``loss_entropy:sum`` (each term's contribution, 0 when off); ``kl_divergence:mean`` (mean per-token
        estimate, only when ``kl_coef > 0``); ``entropy:mean`` (only when ``entropy_coef > 0``); and, for
        losses that read sampler ``logprobs``, ``clip_fraction:mean`` (ratio outside the loss's clip bounds,
        else [0.8, 1.2]), ``mismatch/abs_logprob_diff:mean`` and ``mismatch/kl:mean`` (KL(sampler || trainer),
        k3), measured with the weights as they were before this call's update.
        """
        return self._run(data, loss_fn, loss_fn_config, backward=True)

    def forward_backward_custom(self, data: Sequence[types.Datum], loss_fn) -> types.ForwardBackwardOutput:
        """Gradients of a caller's loss of the targets' logprobs, added to those already accumulated
        (see :mod:`rlrunbook.backend.custom_loss`)."""
        from rlrunbook.backend.custom_loss import forward_backward_custom

        return forward_backward_custom(self, data, loss_fn)

    def note_gradients(self, loss: float) -> None:
        """A backward pass added ``loss``'s gradients: the next ``optim_step`` applies them."""
        self._has_gradients = True
        self._pending_loss += loss

    def _run(self, data: Sequence[types.Datum], loss_fn: str,
             loss_fn_config: Mapping[str, float | str] | None, *, backward: bool) -> types.ForwardBackwardOutput:
        spec = get_loss(loss_fn)
        reg, loss_config = split_regularizer_config(loss_fn_config)
        if reg.kl_coef > 0 and self.full_parameters and not self.scoring.has_reference:
            raise ConfigError(f"kl_coef {reg.kl_coef} needs the KL reference, a copy of the initial weights that this "
                              "full-parameter client was made without: create it with "
                              "create_full_training_client(..., with_reference=True), or set kl_coef 0.")
        mismatch, loss_config = split_mismatch_config(loss_config)
        config = resolve_loss_config(spec, loss_config)
        if len(data) == 0 and self.collective_passes:  # this rank's share is empty: it joins the others' passes
            self.join_passes(0, backward=backward, with_reference=reg.kl_coef > 0)
            return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[],
                                               metrics={"loss:sum": 0.0, "num_tokens:sum": 0.0,
                                                        "num_trained_tokens:sum": 0.0, "micro_batches:sum": 0.0})
        if len(data) == 0:
            raise InputError("empty batch: forward_backward needs at least one Datum.")
        items = [datum_item(d, i, spec, self.vocab_size, self.max_context) for i, d in enumerate(data)]
        trained = sum(_trained_positions(item, spec) for item in items)
        if spec.uses_advantages and trained == 0 and not self.accept_zero_advantages:
            raise NoLearningSignalError(
                f"No non-zero advantages in batch (nothing to train on): loss {spec.name!r} got "
                f"{len(items)} datums whose advantages are all 0.0, so this step would be a silent no-op. "
                "Rewards were constant within every group (centering made them 0): increase the group size, "
                "use a reward with more spread, or raise the temperature. (Code written for the hosted service, "
                "which trains such a batch as a no-op, can set TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES=accept.)"
            )
        batches = micro_batches([item.input_tokens for item in items], self.micro_batch_tokens, self.grad_accum_chunks)
        self.join_passes(len(batches), backward=backward, with_reference=reg.kl_coef > 0)
        logprobs: list[torch.Tensor] = []
        sampling: list[torch.Tensor] = []
        loss_total = 0.0
        parts: list[_ChunkOutput] = []
        self.recomputed_passes = 0
        kept_tokens = 0
        for index, batch in enumerate(batches):
            recompute = self.recompute_layers and backward and needs_recompute(self.plain_cost, batch.tokens,
                                                                                 self.device)
            self.recomputed_passes += recompute
            part = self._chunk_loss(items[batch.start:batch.stop], spec, config, reg, mismatch, recompute,
                                    last=index == len(batches) - 1)
            kept_tokens += getattr(self.scoring, "kept_tokens", 0)
            if backward:
                part.loss.backward()
                self._has_gradients = True
            loss_total += float(part.loss.detach())
            if backward:
                self._pending_loss += float(part.loss.detach())
            logprobs += part.logprobs
            sampling += part.sampling_logprobs
            parts.append(part)
        metrics = _merge_metrics(parts)
        metrics.update({
            "loss:sum": loss_total,
            "num_tokens:sum": float(sum(len(item.input_tokens) for item in items)),
            "num_trained_tokens:sum": float(trained),
            # LOCAL EXTENSION: how the batch was split (see micro_batches), for the step's log row.
            "micro_batches:sum": float(len(batches)),
            "micro_batch_tokens:max": float(max(batch.tokens for batch in batches)),
            # LOCAL EXTENSION: distinct tokens whose projection outputs the sampler had kept
            # (engines/kept_products.py).
            "kept_product_tokens:sum": float(kept_tokens),
        })
        outputs = [{"logprobs": types.TensorData.from_torch(lp)} for lp in logprobs]
        if sampling:  # the caller named the sampler's transform (a local extension)
            for output, values in zip(outputs, sampling, strict=True):
                output["sampling_logprobs"] = types.TensorData.from_torch(values)
        return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs,
                                           metrics=metrics)

    def _weights_moved(self) -> None:
        """An optimizer step or a load changed the weights: a new version, and the sampler's kept products, which no
        pass can read any more, freed."""
        self.weights_version += 1
        drop = getattr(self.scoring, "drop_kept", None)
        if drop is not None:
            drop()

    def join_passes(self, passes: int, *, backward: bool, with_reference: bool = False) -> None:
        """A sharded model under torchrun: as many extra passes as other ranks run beyond this rank's ``passes``.

        Every pass of a sharded model gathers weights with every rank (and its backward reduces gradients with
        every rank), so ranks must run the same number: the rank with the most micro-batches sets it, and the
        others run passes over two padding tokens whose loss is 0 (their gradients add exact zeros).
        """
        if not self.collective_passes:
            return
        most = distributed.all_reduce_max(passes)
        for _ in range(most - passes):
            loss = self.scoring.idle_pass(self.pad_token_id, with_reference)
            if backward:
                loss.backward()

    def _chunk_loss(self, chunk: list[TrainingItem], spec: LossSpec, config: dict[str, float], reg: RegularizerConfig,
                    mismatch: MismatchConfig, recompute: bool | None = None, last: bool = False) -> _ChunkOutput:
        """One forward over ``chunk``: the loss's value plus the regularizer terms, and their metrics (``last``: the
        call's last pass, which frees the sampler's kept products as it reads them)."""
        device = self.device
        scores = self.scoring.score(chunk, mismatch.filters, with_entropy=reg.entropy_coef > 0,
                                    with_reference=reg.kl_coef > 0, recompute=recompute, last=last)
        sampling = _per_datum(chunk, scores.seen_sampling_logprobs) if mismatch.stated else []
        flat_lp = scores.seen_logprobs  # (N,) row-major: datum by datum, as the inputs below
        if flat_lp.numel() == 0:  # nothing sampled in this chunk: no loss, but keep the graph for backward
            return _ChunkOutput(scores.anchor, scores.per_datum, {}, 0, sampling_logprobs=sampling)
        flat_inputs = {key: torch.cat([item.inputs[key][item.mask] for item in chunk]).to(device)
                       for key in (*spec.required_inputs, *spec.optional_inputs)}
        if spec.per_sequence:  # a datum is one sequence
            flat_inputs["sequence_index"] = torch.cat(
                [torch.full((int(item.mask.sum()),), index) for index, item in enumerate(chunk)]).to(device)
        stats: dict[str, torch.Tensor] = {}
        if "logprobs" in spec.required_inputs:
            stats.update(_sampler_terms(flat_lp, flat_inputs, scores.seen_sampling_logprobs.to(device), mismatch,
                                        config, token_clip_fraction=not spec.per_sequence))
        out = spec.fn(flat_lp, flat_inputs, config)
        stats["loss_pg:sum"] = out.loss
        regularized = torch.cat([item.regularized[item.mask] for item in chunk]).to(device)  # (N,)
        reg_loss, reg_stats, n_regularized = _regularizer_terms(scores, regularized, reg)
        stats.update(reg_stats)
        names = list(stats)
        values = torch.stack([stats[name].detach().float() for name in names]).tolist()  # one host sync
        metrics = {**out.metrics, **dict(zip(names, values, strict=True))}
        weights = {name: n_regularized for name in _REGULARIZED_MEANS if name in metrics}
        return _ChunkOutput(out.loss + reg_loss, scores.per_datum, metrics, int(flat_lp.numel()), weights, sampling)

    def optim_step(self, params: types.AdamParams) -> types.OptimStepResponse:
        """One AdamW step (torch.optim.AdamW semantics) on the accumulated gradient, then zero it.

        ``grad_clip_norm > 0`` clips the global norm first. A NaN/inf gradient norm refuses the
        step: gradients are dropped, weights stay as they were, ``NonFiniteGradientError`` is raised.
        Under torchrun the gradients are first summed over ranks (see ``_sync_gradients``), so the
        norm, the clipping, the NaN guard and the step are the same on every rank.
        """
        check_adam_params(params)  # nothing is applied with a NaN, infinite or out-of-range hyperparameter
        trainable = list(self.trained_parameters().values())
        applied_loss = self._sync_gradients(trainable)
        if not self._has_gradients:
            raise InputError("optim_step with no accumulated gradient: call forward_backward first.")
        hyper = dict(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                     weight_decay=params.weight_decay)
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(trainable, **hyper)
        for group in self._optimizer.param_groups:
            group.update(hyper)
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
        grad_norm = float(sharding.full_value(torch.nn.utils.clip_grad_norm_(trainable, max_norm)))
        if not math.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
            self._has_gradients = False
            sharding.gather(self.model)  # full-parameter training: the unchanged weights in place for sampling
            raise NonFiniteGradientError(
                f"gradient norm is {grad_norm}: the step was refused and the weights are unchanged. "
                "Look for a NaN/inf loss input (advantages, sampling logprobs) or lower the learning rate."
            )
        sharding.release(self.model)  # weights a sampler gathered since the last pass would go stale
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._has_gradients = False
        self._weights_moved()
        # Full-parameter training: the new weights in place for sampling until the next training pass, so that
        # sampling calls (whose number may differ between ranks) need no collective.
        sharding.gather(self.model)
        # loss:sum is the summed loss of the forward_backward calls this step applied: recipes that log
        # only optim_step metrics (the cookbook's RL loops) then still record the loss they optimised.
        return types.OptimStepResponse(metrics={"grad_norm:mean": grad_norm,
                                                "learning_rate:mean": params.learning_rate,
                                                "loss:sum": applied_loss})

    def _sync_gradients(self, trainable: list[torch.nn.Parameter]) -> float:
        """Data parallel: sum gradients over ranks; return the summed loss those gradients came from.

        Losses are token sums, so the sum of the ranks' gradients is the gradient of the union
        batch in one process. A rank whose shard produced no datum joins with zeros (no deadlock);
        whether any rank had a gradient and the pending loss ride in the same reduction, so every
        rank then agrees on ``_has_gradients``. With one process nothing is communicated.
        """
        applied_loss, self._pending_loss = self._pending_loss, 0.0
        if distributed.world_size() == 1:
            return applied_loss
        extras = torch.tensor([float(self._has_gradients), applied_loss], dtype=torch.float64, device=self.device)
        if self.full_parameters:  # FSDP2 reduced the gradients in backward
            distributed.all_reduce_sum([extras])
        else:
            for param in trainable:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            distributed.all_reduce_sum([param.grad for param in trainable] + [extras])
        self._has_gradients = bool(extras[0] > 0)
        if not self._has_gradients:
            self.model.zero_grad(set_to_none=True)
        return float(extras[1])

    def state_bytes(self) -> dict[str, int]:
        """Bytes this run holds beside the shared base weights: the adapter, its gradients (between
        ``forward_backward`` and ``optim_step``) and AdamW's moments (after the first step). For full-parameter
        training ``adapter`` counts every weight, and all three count this rank's shards only."""
        trainable = list(self.trained_parameters().values())
        local = sharding.local_bytes
        optimizer = 0
        if self._optimizer is not None:
            optimizer = sum(local(value) for state in self._optimizer.state.values()
                            for value in state.values() if torch.is_tensor(value))
        return {"adapter": sum(local(p) for p in trainable),
                "gradients": sum(local(p.grad) for p in trainable if p.grad is not None),
                "optimizer": optimizer}

    def optimizer_state(self) -> dict | None:
        """AdamW's ``state_dict()`` (tensors and plain numbers only), or None before the first step."""
        return None if self._optimizer is None else self._optimizer.state_dict()

    def export_state(self, *, sharded: bool = False) -> TrainingState:
        """A CPU copy of the adapter and the optimizer state; refused while gradients wait for ``optim_step``.

        Full-parameter training under torchrun: a collective (every rank calls it), and the state lands on rank 0
        only (the other ranks get empty dicts); :meth:`import_state` reads rank 0's likewise. With ``sharded``,
        each rank gets its own shards instead (``shard`` set; no gathering), what a sharded checkpoint writes."""
        if self._has_gradients:
            raise InputError("export_state with accumulated gradients not yet applied: they would be lost; "
                             "call optim_step first (checkpoints are taken between steps).")
        if self.full_parameters and sharded and distributed.world_size() > 1:
            weights, optimizer = sharding.local_state(self.model, self._optimizer)
            sharding.gather(self.model)  # back in place for sampling
            return TrainingState(weights, optimizer, self.weights_version,
                                 shard=(distributed.rank(), distributed.world_size()))
        if self.full_parameters:  # gathered on rank 0 (empty elsewhere); a collective under torchrun
            weights, optimizer = sharding.full_state(self.model, self._optimizer)
            sharding.gather(self.model)  # back in place for sampling
            return TrainingState(weights, optimizer, self.weights_version)
        adapter = {name: p.detach().to("cpu", copy=True) for name, p in adapter_parameters(self.model).items()}
        optimizer = None if self._optimizer is None else sharding.to_cpu(self._optimizer.state_dict())
        return TrainingState(adapter, optimizer, self.weights_version)

    def import_state(self, state: TrainingState, *, with_optimizer: bool = True) -> None:
        """Copy ``state``'s adapter into the model (names and shapes must match exactly) and, with
        ``with_optimizer``, continue AdamW from its moments and step counts; else the optimizer restarts."""
        if self.full_parameters:
            self._import_full(state, with_optimizer)
            return
        params = adapter_parameters(self.model)
        if params.keys() != state.adapter.keys():
            missing = sorted(params.keys() - state.adapter.keys())[:2]
            unexpected = sorted(state.adapter.keys() - params.keys())[:2]
            raise ConfigError(f"the saved adapter does not fit this model's LoRA layout (missing {missing}, "
                              f"unexpected {unexpected}): it was trained with other LoRA targets or another base "
                              "model; load it into a client made with the run's model and rank.")
        for name, param in params.items():
            if tuple(param.shape) != tuple(state.adapter[name].shape):
                raise ConfigError(f"adapter tensor {name} has shape {tuple(state.adapter[name].shape)}, the model's "
                                  f"is {tuple(param.shape)}: the checkpoint used another LoRA rank.")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state.adapter[name])
        self.weights_loaded(state.optimizer if with_optimizer else None, keep_optimizer=with_optimizer)

    def _import_full(self, state: TrainingState, with_optimizer: bool) -> None:
        """A full state into the sharded model; under torchrun rank 0's state is the one loaded (and checked), or
        each rank's own shards of a sharded state (each checks its own; every rank raises if one cannot load)."""
        if state.shard is not None:
            self._import_shards(state, with_optimizer)
            return
        params = self.trained_parameters()
        problem = None
        if distributed.is_main() and params.keys() != state.adapter.keys():
            missing = sorted(params.keys() - state.adapter.keys())[:2]
            unexpected = sorted(state.adapter.keys() - params.keys())[:2]
            problem = (f"the saved weights do not fit this model (missing {missing}, unexpected {unexpected}): they "
                       "are another model's, or a LoRA adapter (which loads into a LoRA client); load a full state "
                       "of the run's model.")
        keep = with_optimizer and state.optimizer is not None
        problem, keep = distributed.broadcast_object((problem, keep))  # every rank takes rank 0's decision
        if problem is not None:
            raise ConfigError(problem)
        self._drop_gradients()
        self._optimizer = torch.optim.AdamW(list(params.values())) if keep else None
        sharding.load_full_state(self.model, state.adapter, self._optimizer, state.optimizer if keep else None)
        self._weights_moved()
        sharding.gather(self.model)

    def _import_shards(self, state: TrainingState, with_optimizer: bool) -> None:
        here = (distributed.rank(), distributed.world_size())
        keep = with_optimizer and state.optimizer is not None
        self._drop_gradients()
        params = self.trained_parameters()
        self._optimizer = torch.optim.AdamW(list(params.values())) if keep else None
        problem = None
        if state.shard != here:
            problem = f"rank {here[0]} of {here[1]} was given rank {state.shard[0]} of {state.shard[1]}'s shards"
        else:
            try:
                sharding.load_local_state(self.model, state.adapter, self._optimizer, state.optimizer if keep else None)
            except ValueError as error:
                problem = str(error)
        problems = [p for p in distributed.gather_objects(problem) if p is not None]
        if problems:
            self._optimizer = None
            raise ConfigError(f"the saved shards do not load: {problems[0]}. Load a checkpoint of the run's model "
                              "(at another world size its shards are joined into whole tensors first).")
        self._weights_moved()
        sharding.gather(self.model)

    def _drop_gradients(self) -> None:
        """Forget the gradients and loss accumulated for the next optimizer step (new weights are coming in)."""
        self.model.zero_grad(set_to_none=True)
        self._has_gradients = False
        self._pending_loss = 0.0

    def parameter_names(self) -> list[str]:
        """The trained parameters in the optimizer's order (its state is keyed by position)."""
        return list(self.trained_parameters())

    def weights_loaded(self, optimizer_state: dict | None, *, keep_optimizer: bool) -> None:
        """Call after new adapter weights were copied in: drop gradients, set the optimizer, bump the version.

        ``keep_optimizer`` restores ``optimizer_state`` (AdamW moments and step counts; hyperparameters
        are set again by every ``optim_step``); otherwise the optimizer starts fresh at the next step.
        """
        self._drop_gradients()
        self._optimizer = None
        if keep_optimizer and optimizer_state is not None:
            optimizer = torch.optim.AdamW(list(self.trained_parameters().values()))
            optimizer.load_state_dict(optimizer_state)
            self._optimizer = optimizer
        self._weights_moved()
