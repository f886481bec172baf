"""Step guards: the non-finite step refusal and the sampler-trainer mismatch gate.

* **Non-finite step** (:func:`finite_optim_step`). A step whose ``loss:sum`` is NaN/inf is refused
  before ``optim_step`` is submitted; a NaN/inf gradient norm is refused by the trainer
  (``NonFiniteGradientError``, weights untouched) or, for a backend that only reports it after
  applying the step, here (the record then says ``weights_changed: true``). Either way the run
  stops with :class:`NonFiniteStepError` and ``run_metadata.json`` records the refused step under
  ``refused_step``. A non-finite *reward* is refused earlier, where it is scored
  (:func:`checked_reward`, ``RolloutContext.score``), naming the task and the problem.
* **Mismatch** (``mismatch.warn``, ``mismatch.max``). A step whose mean |sampler - trainer| logprob
  exceeds the gate is refused before ``optim_step`` (or, under data parallelism, recorded after it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from rlrunbook.errors import LogprobMismatchError, RlrunbookError


class NonFiniteStepError(RlrunbookError, FloatingPointError):
    """A step's loss or gradient norm was NaN/inf: the step was refused and the weights are untouched."""


# --- non-finite steps ------------------------------------------------------------------------------

def _refuse(writer, step: int, quantity: str, value: float | None, cause: str, *, applied: bool = False
            ) -> NonFiniteStepError:
    """Record the refused step in ``run_metadata.json`` and make the error that stops the run."""
    writer.record_refused_step({"step": step, "quantity": quantity, "value": None if value is None else repr(value),
                                "cause": cause, "weights_changed": applied})
    outcome = ("the backend had already applied it: the weights after this step are suspect" if applied else
               "the optimizer step was not applied and the weights are unchanged")
    return NonFiniteStepError(
        f"step {step} refused: {quantity} is {'non-finite' if value is None else repr(value)} ({cause}); {outcome}. "
        "Look for NaN/inf rewards, advantages or sampling logprobs in the step's rollouts, or lower --learning-rate.")


def finite_optim_step(training, step: int, fb_metrics: Mapping[str, float], params, writer, *,
                      check_loss: bool = True):
    """Apply ``optim_step(params)`` only after a finite ``loss:sum``; refuse a non-finite gradient norm.

    Waiting for forward_backward's loss before submitting the optimizer step costs one round trip
    and guarantees that a NaN loss never reaches the weights, whatever the backend does with it.
    ``check_loss=False`` (data parallel: every rank must join the step's gradient all-reduce) leaves
    a NaN loss to the trainer, whose summed gradient norm is then NaN on every rank.
    """
    loss = float(fb_metrics["loss:sum"])
    if check_loss and not math.isfinite(loss):
        raise _refuse(writer, step, "loss:sum", loss, "forward_backward returned a non-finite loss")
    try:
        optim = training.optim_step(params).result()
    except FloatingPointError as error:  # the local trainer's NonFiniteGradientError: nothing was applied
        reason = str(error).split(":", 1)[0]  # the trainer's "gradient norm is inf"
        raise _refuse(writer, step, "grad_norm", None,
                      f"the trainer refused the step: {type(error).__name__}: {reason}") from error
    grad_norm = float((optim.metrics or {}).get("grad_norm:mean", 0.0))
    if not math.isfinite(grad_norm):  # a backend that reports, but does not refuse, a non-finite norm
        raise _refuse(writer, step, "grad_norm", grad_norm, "optim_step reported a non-finite gradient norm",
                      applied=True)
    return optim


# --- sampler-trainer mismatch ----------------------------------------------------------------------

MISMATCH_METRIC = "mismatch/abs_logprob_diff:mean"


def check_mismatch(step: int, fb_metrics: Mapping[str, float], settings, temperature: float, writer,
                   log: Callable[[str], None], *, applied: bool = False) -> None:
    """Warn above ``settings.warn`` and stop above ``settings.max`` (both divided by T below 1).

    ``fb_metrics`` are forward_backward's; a backend that does not report the mismatch (the hosted
    service) is not gated. ``applied``: the optimizer step already ran (data parallel checks the
    merged metric after it), which the refusal records.
    """
    if MISMATCH_METRIC not in fb_metrics:
        return
    value = float(fb_metrics[MISMATCH_METRIC])
    scale = 1.0 / temperature if 0 < temperature < 1 else 1.0
    if value > settings.max * scale or not math.isfinite(value):
        writer.record_refused_step({"step": step, "quantity": "mismatch/abs_logprob_diff", "value": repr(value),
                                    "cause": f"above mismatch.max {settings.max * scale:.3g}",
                                    "weights_changed": applied})
        raise LogprobMismatchError(
            f"step {step} refused: the sampler and the trainer disagree by {value:.4f} nats per trained token "
            f"(mean |Δ| under the sampled distribution), above mismatch.max = {settings.max * scale:.3g}"
            f"{'' if scale == 1 else f' (= {settings.max} / T)'}; "
            f"{'the optimizer step had already been applied' if applied else 'the weights are unchanged'}. "
            "Their numerics differ: run `rlrunbook check-logprobs` with this run's settings, use "
            "the default TINKER_LOCAL_NUMERICS=invariant (bitwise by construction), or correct for it with "
            "mismatch.correction=truncate and a higher mismatch.max.")
    if value > settings.warn * scale:
        log(f"[warn] step {step}: sampler-trainer mismatch {value:.4f} nats/token is above mismatch.warn "
            f"{settings.warn * scale:.3g}; ratios and losses are biased by it (see `rlrunbook check-logprobs`).")
