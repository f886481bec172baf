"""One optimizer step: sample → score → advantages → datums → forward_backward → optim_step → log.

:func:`one_step` reads the run's :class:`~rlrunbook.rl.training.plan.RunPlan`; the paradigm samples and scores
the step's groups (with dynamic sampling refilling tied ones), the datums of the groups with reward spread are
trained, the step guards gate the update, and the step's files and log row are written.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tinker import types

from rlrunbook import distributed
from rlrunbook.rl.rollout.judges import Judge
from rlrunbook.rl.rollout.paradigms import RolloutContext
from rlrunbook.rl.rollout.rollouts import step_record, to_datum
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.rl.setup.service import is_local
from rlrunbook.rl.training import data_parallel as dp
from rlrunbook.rl.training.dynamic_sampling import SampledStep, count_skip, sample_step, skip_reason
from rlrunbook.rl.training.lag_schedule import Lag
from rlrunbook.rl.training.plan import RunPlan
from rlrunbook.rl.training.step_guards import check_mismatch, finite_optim_step
from rlrunbook.run import RunWriter

# forward_backward metrics logged in every train_log row (the offline GRPO trainer's names), when reported:
# the loss split into its policy-gradient, KL and entropy terms, the KL to the reference and the entropy
# (when those terms are on), the fraction of clipped importance ratios, and the sampler-trainer mismatch.
TRAINER_METRICS = {
    "loss_pg:sum": "loss_pg", "loss_kl:sum": "loss_kl", "loss_entropy:sum": "loss_entropy",
    "kl_divergence:mean": "kl_divergence", "entropy:mean": "entropy", "clip_fraction:mean": "clip_fraction",
    "mismatch/abs_logprob_diff:mean": "mismatch/abs_logprob_diff", "mismatch/kl:mean": "mismatch/kl",
    "mismatch/corrected_fraction:mean": "mismatch/corrected_fraction",
    "micro_batches:sum": "micro_batches", "micro_batch_tokens:max": "micro_batch_tokens",
    "kept_product_tokens:sum": "kept_product_tokens",
}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}


def verdict_stats(rollouts) -> dict[str, float]:
    """Debate: the verdicts apart from the task reward. ``reward`` is the verdict (1 won, 0 lost), whose mean
    is 0.5 by construction when each debate has one winner; what the winners' training (rejection, rs_grpo)
    optimises is the task reward of the winning side, shown beside that of the losers. Empty outside debate."""
    judged = [r for r in rollouts if r.won is not None]
    if not judged:
        return {}
    winners = [r.task_reward for r in judged if r.won]
    losers = [r.task_reward for r in judged if not r.won]
    stats = {"verdict/win_rate": len(winners) / len(judged)}
    if winners:
        stats["task_reward/winners_mean"] = statistics.fmean(winners)
    if losers:
        stats["task_reward/losers_mean"] = statistics.fmean(losers)
    return stats


def _reward_line(step: int, rollouts, rewards: dict[str, float], task_rewards: dict[str, float]) -> str:
    verdicts = verdict_stats(rollouts)
    if not verdicts:
        return f"Step {step}: reward {rewards['mean']:.4f} (task {task_rewards['mean']:.4f})"
    winners = verdicts.get("task_reward/winners_mean", float("nan"))
    return (f"Step {step}: verdict win rate {verdicts['verdict/win_rate']:.4f} (one winner per debate), "
            f"task reward of the winners (trained) {winners:.4f}, of all debaters {task_rewards['mean']:.4f}")


def _memory_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB
    return round(peak, 1)


@dataclass(frozen=True)
class ProcessUsage:
    """The process's minor page faults and system CPU seconds so far (``getrusage``). A step's row logs their
    growth over the step (:meth:`since`): memory the process touches for the first time shows there, as faults and
    as the kernel's time clearing the pages (a run's first steps; every step, where freed memory goes back to the
    system). Process-wide: an asynchronous run's rollout thread counts in the step it overlaps."""

    minor_faults: int
    system_s: float

    @classmethod
    def now(cls) -> ProcessUsage:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(usage.ru_minflt, usage.ru_stime)

    def since(self) -> dict[str, float]:
        """``memory/minor_faults`` and ``time/system_cpu_s`` from this reading to now."""
        now = ProcessUsage.now()
        return {"memory/minor_faults": now.minor_faults - self.minor_faults,
                "time/system_cpu_s": round(now.system_s - self.system_s, 3)}


def sample_batch(plan: RunPlan, step: int, sampler, tokenizer, judge: Judge | None, log,
                 cursor: DataCursor) -> SampledStep:
    """Sample step ``step``'s groups from ``sampler`` with dynamic sampling (tied groups replaced; see
    rl/training/dynamic_sampling.py); ``cursor.next_problem`` advances by the groups drawn."""

    def rollout(chosen, group_ids):
        ctx = RolloutContext(sampler, tokenizer, plan.task, plan.rollout, [tokenizer.eos_token_id], judge, log,
                             group_ids=group_ids)
        return plan.paradigm.rollout(ctx, chosen, step)

    return sample_step(plan.config, step, cursor, plan.training_problems, plan.order, rollout, plan.advantages_of,
                       log)


def _skip_step(config, step: int, sampled: SampledStep, writer: RunWriter, log, cursor: DataCursor,
               started: float, lag: Lag | None = None, usage: ProcessUsage | None = None) -> None:
    """A step without enough groups with spread: no update; a step file and a log row marked ``skipped``."""
    count_skip(config, step, cursor, sampled, sampled.drawn.rollouts)  # NoLearningSignalError at the limit
    reason = skip_reason(config, sampled)
    writer.write_step(step, {"skipped": True, "skip_reason": reason, "loss_fn": config.loss_fn,
                             "training_data": [], "num_trained_tokens": 0})
    batch, done = sampled.drawn, time.perf_counter()
    writer.log_step({
        "step": step, "skipped": True, "skip_reason": reason,
        **{f"reward/{k}": v for k, v in _stats([r.reward for r in batch.rollouts]).items()},
        **{f"task_reward/{k}": v for k, v in _stats([r.task_reward for r in batch.rollouts]).items()},
        **verdict_stats(batch.rollouts), **sampled.metrics(), "num_datums": 0, "num_trained_tokens": 0,
        "completion_length/mean": statistics.fmean(r.own_token_count for r in batch.rollouts),
        "time/sample_s": done - started - batch.metrics.get("time/score_s", 0.0),
        "time/score_s": batch.metrics.get("time/score_s", 0.0), "time/step_s": done - started,
        "throughput/sampled_tokens_per_s": batch.sampled_tokens / max(1e-9, done - started),
        "memory/rss_mb": _memory_mb(), **(usage.since() if usage is not None else {}),
        **(lag.row({}) if lag is not None else {}),
    })
    log(f"warning: step {step} skipped, no update: {reason}. {cursor.skipped_in_a_row} step(s) skipped in a row; "
        f"the run stops at {config.dynamic_sampling.max_skipped_steps}.")


def one_step(plan: RunPlan, step: int, training, tokenizer, judge: Judge | None, writer: RunWriter, log,
              cursor: DataCursor) -> None:
    """One optimizer step: sample, score, advantages, datums, forward_backward, optim_step, log."""
    started, usage = time.perf_counter(), ProcessUsage.now()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampled = sample_batch(plan, step, sampler, tokenizer, judge, log, cursor)
    train_batch(plan, step, sampled, training, writer, log, cursor, started=started, sampled_at=time.perf_counter(),
                usage=usage)


def train_batch(plan: RunPlan, step: int, sampled: SampledStep, training, writer: RunWriter, log, cursor: DataCursor,
                *, started: float, sampled_at: float, lag: Lag | None = None,
                usage: ProcessUsage | None = None) -> None:
    """Train step ``step`` on ``sampled``: advantages, datums, forward_backward, the gates, optim_step, log.

    ``cursor``: its ``skipped_in_a_row`` is counted here. ``lag`` (an asynchronous run): the batch was sampled
    from older weights; the mismatch gate then reads the mismatch at the sampler's weights (numerics alone)
    and the row also gets the lag's own measures (see :class:`Lag`). ``usage``: read when the step started; the
    row gets its growth (:class:`ProcessUsage`)."""
    config = plan.config
    batch = sampled.drawn
    writer.write_rollouts(batch.kind, step, batch.payload)
    if sampled.skipped:
        _skip_step(config, step, sampled, writer, log, cursor, started, lag, usage)
        return
    cursor.skipped_in_a_row = 0
    advantages = sampled.advantages
    chosen = [(r, a) for r, a in zip(sampled.kept, advantages, strict=True) if a != 0]
    log(f"Training data: {len(chosen)} datums from {len(batch.rollouts)} rollouts")
    datums = [to_datum(r, a) for r, a in dp.own_share(chosen, sampled.own_groups)]
    loss_config = config.loss_fn_config(local=is_local(training)) or None
    # A rank with no datums skips forward_backward, unless every rank's passes are collectives (full-parameter
    # training under torchrun): it then joins the others' passes with an empty batch.
    joins = not datums and getattr(training, "collective_passes", False)
    fb_future = training.forward_backward(datums, config.loss_fn, loss_config) if datums or joins else None
    lag_metrics: dict[str, float] = {}
    if lag is not None and datums:
        lag_metrics = lag.measure(training, datums, config.loss_fn, loss_config, fb_future)
    fb = fb_future.result() if fb_future is not None else None
    fb = fb if datums else None
    fb_done = time.perf_counter()
    single = distributed.world_size() == 1
    if single and fb is not None:  # before optim_step: a refused step leaves the weights unchanged
        check_mismatch(step, {**fb.metrics, **lag.gated(lag_metrics)} if lag is not None else fb.metrics,
                       config.mismatch, config.temperature, writer, log)
    # A NaN/inf loss or gradient norm is refused before it reaches the weights (step_guards.py). Every rank
    # submits optim_step (its gradient all-reduce needs all of them); a NaN on one rank makes the summed
    # gradient norm NaN everywhere, so the trainer refuses the step on every rank alike.
    optim = finite_optim_step(training, step, fb.metrics if fb is not None else {"loss:sum": 0.0}, types.AdamParams(
        learning_rate=config.learning_rate, grad_clip_norm=config.loss.grad_clip_norm), writer,
        check_loss=distributed.world_size() == 1)
    done = time.perf_counter()
    # Only after optim_step (whose gradient all-reduce runs on the backend's thread) has returned:
    # the ranks' collectives must come in the same order on every rank.
    fb_metrics = dp.union_metrics(fb.metrics if fb is not None else {})
    if not single:  # every rank joined the step's all-reduce; all of them see the merged mismatch
        check_mismatch(step, fb_metrics, config.mismatch, config.temperature, writer, log, applied=True)
    trained = int(fb_metrics.get("num_trained_tokens:sum", 0))
    loss = float(fb_metrics["loss:sum"])
    centred = {id(r): a for r, a in chosen}
    writer.write_step(step, {
        "loss_fn": config.loss_fn,
        "training_data": [step_record(r, a, centred.get(id(r))) for r, a in chosen],
        "results": {"metrics": fb_metrics, "optim_metrics": dict(optim.metrics or {})},
        "num_trained_tokens": trained,
    })
    rewards = _stats([r.reward for r in batch.rollouts])
    task_rewards = _stats([r.task_reward for r in batch.rollouts])
    nonzero = [a for a in advantages if a != 0]
    lengths = [r.own_token_count for r in batch.rollouts]  # everything sampled (``batch``); trained: ``sampled.kept``
    row = {
        "step": step,
        **{f"reward/{k}": v for k, v in rewards.items()},
        **{f"task_reward/{k}": v for k, v in task_rewards.items()},
        **verdict_stats(batch.rollouts),
        "advantage/nonzero_count": len(nonzero),
        "advantage/nonzero_fraction": len(nonzero) / len(advantages),
        "advantage/min": min(advantages), "advantage/max": max(advantages),
        "loss/sum": loss, "num_datums": len(chosen), "num_trained_tokens": trained,
        **{name: float(fb_metrics[key]) for key, name in TRAINER_METRICS.items() if key in fb_metrics},
        **(lag.row(lag_metrics) if lag is not None else {}),
        "completion_length/mean": statistics.fmean(lengths),
        "grad_norm": float((optim.metrics or {}).get("grad_norm:mean", float("nan"))),
        "time/sample_s": sampled_at - started - batch.metrics.get("time/score_s", 0.0),
        "time/score_s": batch.metrics.get("time/score_s", 0.0),
        "time/forward_backward_s": fb_done - sampled_at, "time/optim_s": done - fb_done, "time/step_s": done - started,
        "throughput/sampled_tokens_per_s": batch.sampled_tokens / max(1e-9, sampled_at - started),
        "throughput/trained_tokens_per_s": trained / max(1e-9, done - sampled_at),
        "memory/rss_mb": _memory_mb(), **(usage.since() if usage is not None else {}),
        **{k: v for k, v in batch.metrics.items() if k != "time/score_s"},
        **sampled.metrics(),
        **(training.engine_metrics() if is_local(training) else {}),
    }
    writer.log_step({k: v for k, v in row.items() if v == v})  # drop NaN (no grad_norm reported)
    log(f"{_reward_line(step, batch.rollouts, rewards, task_rewards)}, "
        f"Advantage stats (nonzero): count {len(nonzero)}, min {min(nonzero):.4f}, max {max(nonzero):.4f}")
    log(f"Loss: {loss:.4f}  Tokens: {trained}  step {done - started:.1f}s")
