"""The asynchronous loop (``off_policy`` = K > 0): the next K batches are sampled while the trainer trains.

Two threads. The **rollout thread** runs jobs one at a time in the order the loop submits them: sampling a
batch (the paradigm's rollouts, scoring, dynamic sampling) and, when due, a validation. The **loop's own
thread** trains, makes a sampler snapshot of the new weights after each step, submits the jobs those weights
unlock, and writes everything. With the local backend's ``concurrent_sampling`` the rollout thread's sample
calls run on the backend's sampling worker while the loop's training calls run on the training worker, each
on its own weights (backend/futures.py).

What makes it reproducible: nothing depends on which side is faster.

- Batch ``i`` is sampled from the snapshot of the weights after step ``max(0, i - K)``
  (:func:`~rlrunbook.rl.training.lag_schedule.sampling_step`): the snapshot is made by the loop at a fixed point of its
  own sequence (right after that step) and handed to the job, never looked up when the job starts.
- Jobs are submitted in a fixed order (batch ``i + K`` right after step ``i``, a validation of step ``i + 1``
  just before it) and run in that order on one thread, so the data cursor that dynamic sampling advances, and
  the sampling engine's calls and caches, follow the same sequence in every run.
- Every sampling request is seeded by ``(seed, step, group)``; the trainer's steps come in step order.

A batch is thus off-policy by exactly ``min(i, K)`` steps (``async/staleness``), bounded by admission, not by
dropping rollouts that came back too old (DESIGN §4, "Asynchronous training").

Checkpoints: a checkpoint after ``c`` steps also holds the snapshots of the steps ``max(0, c - K) .. c - 1``,
from which the batches ``c .. c + K - 1`` are (re-)sampled, and the data cursor before batch ``c``; a resumed
run re-derives its in-flight batches from them and repeats the straight run bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlrunbook import pending_signal
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.rl.training.dynamic_sampling import SampledStep
from rlrunbook.rl.training.lag_schedule import Lag, sampling_step, staleness
from rlrunbook.rl.training.plan import RunPlan
from rlrunbook.rl.training.step import ProcessUsage, sample_batch, train_batch


@dataclass
class _Sampled:
    sampled: SampledStep
    next_problem: int  # the data cursor after this batch: where the next batch starts drawing
    seconds: float


class _Snapshot:
    """Stands in for the training client where a job needs "a sampler of the weights now" (the validator):
    it gets the snapshot the loop made at the scheduled point, whenever the job runs."""

    def __init__(self, sampler):
        self._sampler = sampler

    def save_weights_and_get_sampling_client(self, *args, **kwargs):
        return self._sampler


def run_off_policy(plan: RunPlan, steps: Iterable[int], first: int, training, tokenizer, judge, writer, log,
                   cursor: DataCursor, samplers: dict[int, object], validate: Callable[[int, object], None],
                   checkpoint: Callable[[int, DataCursor, dict[int, dict]], None]) -> None:
    """Train steps ``first ..`` with up to ``K`` batches sampled ahead (see the module docstring).

    ``samplers``: snapshots already made, by the step whose weights they hold (a resumed run's in-flight ones);
    the current weights' snapshot is made here. ``validate(steps_done, training_like)`` validates when due;
    ``checkpoint(completed, cursor, sampler_adapters)`` saves when due.
    """
    config = plan.config
    k, total = config.off_policy, config.steps
    samplers = dict(samplers)
    samplers[first] = training.save_weights_and_get_sampling_client()
    sampling_cursor = DataCursor(next_problem=cursor.next_problem)  # advanced on the rollout thread only
    next_problem = {first - 1: cursor.next_problem}
    pending: dict[int, Future] = {}
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlrunbook-rollouts")

    def submit_batch(batch: int) -> None:
        sampler = samplers[sampling_step(batch, k)]  # fixed here, by the schedule, before the job exists

        def job() -> _Sampled:
            started = time.perf_counter()
            sampled = sample_batch(plan, batch, sampler, tokenizer, judge, log, sampling_cursor)
            return _Sampled(sampled, sampling_cursor.next_problem, time.perf_counter() - started)

        pending[batch] = executor.submit(job)

    try:
        for batch in range(first, min(first + k, total - 1) + 1):
            submit_batch(batch)
        for step in steps:
            pending_signal.raise_pending()  # a signal that a library swallowed stops the run here
            waited, usage = time.perf_counter(), ProcessUsage.now()
            got = pending.pop(step).result()
            arrived = time.perf_counter()
            next_problem[step] = got.next_problem
            lag = Lag(staleness(step, k), samplers[sampling_step(step, k)], got.seconds, arrived - waited)
            train_batch(plan, step, got.sampled, training, writer, log, cursor, started=waited, sampled_at=arrived,
                        lag=lag, usage=usage)
            done = step + 1
            if done < total:
                samplers[done] = training.save_weights_and_get_sampling_client()
            if plan.validator.due and done in plan.validator.due:  # in the rollout thread's order, then waited for
                snapshot = samplers.get(done) or training.save_weights_and_get_sampling_client()
                executor.submit(validate, done, _Snapshot(snapshot)).result()
            if done + k < total:
                submit_batch(done + k)
            for old in [v for v in samplers if v < sampling_step(done, k)]:
                del samplers[old]  # no batch from ``done`` on is sampled from it
            kept = {v: samplers[v].weights_state() for v in range(sampling_step(done, k), done)}
            checkpoint(done, DataCursor(next_problem[step], cursor.skipped_in_a_row), kept)
    except BaseException:  # a failed step or Ctrl-C: stop at once; the service's own stop ends a running job
        for future in pending.values():
            future.cancel()
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown(wait=True)


def restore_samplers(training, adapters: dict[int, dict], first: int, off_policy: int) -> dict[int, object]:
    """Snapshots of a resumed run's in-flight weights (``adapters`` by step, from its checkpoint): each is
    loaded into ``training`` and snapshotted. Call before the checkpoint's own state is restored, which then
    replaces the adapter and the optimizer."""
    from rlrunbook.backend.trainer import TrainingState
    from rlrunbook.errors import ConfigError

    needed = range(sampling_step(first, off_policy), first)
    missing = [v for v in needed if v not in adapters]
    if missing:
        raise ConfigError(f"the checkpoint at step {first} lacks the sampler weights of steps {missing}, from which "
                          f"an asynchronous run (off_policy {off_policy}) samples its next batches: it was written "
                          "by another version. Resume from a checkpoint this version wrote, or start a new run.")
    samplers = {}
    for v in needed:
        training.import_training_state(TrainingState(adapters[v], None, 0), with_optimizer=False)
        samplers[v] = training.save_weights_and_get_sampling_client()
    return samplers


def run_dir_checkpointer(plan: RunPlan, training, run_dir: Path, log):
    """``checkpoint(completed, cursor, sampler_adapters)`` for :func:`run_off_policy`: the run's schedule."""
    def checkpoint(completed: int, cursor: DataCursor, sampler_adapters: dict[int, dict]) -> None:
        plan.checkpoints.save_if_due(training, run_dir, completed, cursor, log, sampler_adapters=sampler_adapters)

    return checkpoint
