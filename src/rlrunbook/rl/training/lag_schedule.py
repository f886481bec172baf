"""The lag of an asynchronous run: which weights a batch is sampled from, and what that lag does to a step.

The schedule is a pure function of the batch index and ``off_policy`` (K): batch ``i`` is sampled from the
weights after step ``max(0, i - K)``, never from "whatever is newest when the sampler gets to it". So the
same seed and K give the same tokens and the same losses however fast either side runs, and a resumed run
can re-derive the batches that were in flight (see :mod:`rlrunbook.rl.training.off_policy`).

A batch sampled ``s`` steps ago differs from the trainer's current policy for two reasons: the lag (the
weights moved ``s`` steps) and the numerics (sampler and trainer round differently even at equal weights).
The mismatch gate is about the second: it compares the trainer at the sampler's weights against the
sampler's logprobs (``forward_on_sampler_weights``, a local-backend extension that costs one forward pass
per lagging step). The first is logged beside it, never gated: ``async/lag_abs_logprob_diff`` is the mean
|trainer now - trainer at the sampler's weights| per trained token, and ``async/mismatch_total`` the mean
|trainer now - sampler|, which the importance correction (``mismatch.correction``) reweights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MISMATCH_METRIC = "mismatch/abs_logprob_diff:mean"
MISMATCH_KL_METRIC = "mismatch/kl:mean"


def sampling_step(batch: int, off_policy: int) -> int:
    """The step whose weights (those after ``max(0, batch - K)`` optimizer steps) batch ``batch`` is sampled from."""
    if batch < 0 or off_policy < 0:
        raise ValueError(f"batch {batch} and off_policy {off_policy} must be >= 0")
    return max(0, batch - off_policy)


def staleness(batch: int, off_policy: int) -> int:
    """Steps between the weights batch ``batch`` was sampled from and those that train on it: ``min(batch, K)``."""
    return batch - sampling_step(batch, off_policy)


def mean_abs_gap(now: Sequence[Sequence[float]], then: Sequence[Sequence[float]],
                 masks: Sequence[Sequence[bool]]) -> float:
    """Mean |now - then| over the masked positions of every datum (0.0 when none is masked)."""
    total, count = 0.0, 0
    for a, b, m in zip(now, then, masks, strict=True):
        a, b, m = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), np.asarray(m, dtype=bool)
        total += float(np.abs(a - b)[m].sum())
        count += int(m.sum())
    return total / count if count else 0.0


def _logprobs(output) -> list[list[float]]:
    return [np.asarray(o["logprobs"].to_numpy() if hasattr(o["logprobs"], "to_numpy") else o["logprobs"]).tolist()
            for o in output.loss_fn_outputs]


@dataclass
class Lag:
    """What the training step of a batch sampled ahead needs to know of it, and what it measures."""

    staleness: int  # steps between the sampling weights and the trained weights (the schedule's, not timing's)
    sampler: object  # the sampling client the batch was drawn from (its weights: those of step - staleness)
    sample_s: float  # seconds the batch took to sample and score, on the rollout thread
    wait_s: float  # seconds the trainer waited for it

    def measure(self, training, datums, loss_fn: str, loss_config, fb_future) -> dict[str, float]:
        """With a lag and the local backend: the mismatch at the sampler's weights and the lag's own size."""
        forward = getattr(training, "forward_on_sampler_weights", None)
        if self.staleness == 0 or forward is None:
            return {}
        then = forward(self.sampler, datums, loss_fn, loss_config).result()
        now = fb_future.result()
        masks = [np.asarray(d.loss_fn_inputs["advantages"].to_numpy()) != 0 for d in datums]
        measured = {"lag": mean_abs_gap(_logprobs(now), _logprobs(then), masks)}
        for key, name in ((MISMATCH_METRIC, "numeric"), (MISMATCH_KL_METRIC, "numeric_kl")):
            if key in then.metrics:
                measured[name] = float(then.metrics[key])
        if MISMATCH_METRIC in now.metrics:
            measured["total"] = float(now.metrics[MISMATCH_METRIC])
        return measured

    @staticmethod
    def gated(measured: Mapping[str, float]) -> dict[str, float]:
        """The metrics the mismatch gate reads in place of forward_backward's (numerics at equal weights)."""
        return {MISMATCH_METRIC: measured["numeric"]} if "numeric" in measured else {}

    def row(self, measured: Mapping[str, float]) -> dict[str, float]:
        """The step's ``async/*`` columns; ``mismatch/*`` become the numerical mismatch at equal weights."""
        row = {"async/staleness": self.staleness, "async/sample_s": self.sample_s, "async/wait_s": self.wait_s,
               "async/lag_abs_logprob_diff": measured.get("lag", 0.0)}
        if "total" in measured:
            row["async/mismatch_total"] = measured["total"]
        if "numeric" in measured:
            row["mismatch/abs_logprob_diff"] = measured["numeric"]
        if "numeric_kl" in measured:
            row["mismatch/kl"] = measured["numeric_kl"]
        return row
