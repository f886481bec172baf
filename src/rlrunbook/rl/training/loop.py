"""The training loop: a run planned once, then step after step (see :mod:`rlrunbook.rl.training.step`).

Each step: sample → score → advantages → datums → forward_backward → optim_step → sync → log; with
``off_policy`` K > 0 the sampling of the next K steps overlaps the training (:mod:`rlrunbook.rl.training.off_policy`). It talks
only to the Tinker-style clients, so it runs on the local backend and on the hosted service alike. Everything a run can get wrong in its options or data fails before a model loads;
a run that fails later is marked ``failed`` in its metadata, so its directory never passes the rubric.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from rlrunbook import distributed, pending_signal
from rlrunbook.rl.rollout.guards import check_prompts
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.rl.setup.memory_plan import format_plan
from rlrunbook.rl.setup.service import default_service, seed_everything, training_client
from rlrunbook.rl.training import data_parallel as dp
from rlrunbook.rl.training.interrupt import interrupted
from rlrunbook.rl.training.off_policy import restore_samplers, run_dir_checkpointer, run_off_policy
from rlrunbook.rl.training.plan import RunPlan, plan_run
from rlrunbook.rl.training.step import one_step
from rlrunbook.run import RunWriter, wandb_sink


def run_training(config: TrainConfig, *, service_factory: Callable[[], object] | None = None,
                 argv: Sequence[str] = (), config_sources: dict[str, str] | None = None,
                 log: Callable[[str], None] = print, progress: Callable | None = None,
                 evaluate: Callable[[str, object, object], None] | None = None,
                 resume_from: str | Path | None = None) -> Path:
    """Run ``config`` and return its run directory (see DESIGN §5 for the files it holds).

    The config is read once, into a :class:`~rlrunbook.rl.training.plan.RunPlan` (every mistake in it
    fails there, before any model loads); :func:`train` runs the plan.
    ``resume_from`` (a run directory or one of its checkpoints) continues that run in a new run
    directory, with the checkpoint's config (see :mod:`rlrunbook.rl.setup.resume`).
    """
    plan = plan_run(config, resume_from=resume_from, sources=config_sources)
    return train(plan, service_factory=service_factory, argv=argv, log=log, progress=progress, evaluate=evaluate)


def train(plan: RunPlan, *, service_factory: Callable[[], object] | None = None, argv: Sequence[str] = (),
          log: Callable[[str], None] = print, progress: Callable | None = None,
          evaluate: Callable[[str, object, object], None] | None = None) -> Path:
    """Run ``plan`` and return its run directory.

    ``evaluate(label, training_client, tokenizer)``, if given, is called with ``"initial"`` before
    the first step and ``"final"`` after the last: the hook for held-out evaluation.

    Under ``torchrun`` (see :mod:`rlrunbook.rl.training.data_parallel`) every process samples and trains
    its block of each step's groups; rank 0 alone creates and writes the run directory (and its
    checkpoints) and logs, and every rank returns its path once rank 0 has finished it.
    """
    config, resume, task = plan.config, plan.resume, plan.task
    distributed.init(plan.layout, device=plan.device)
    if not distributed.is_main():
        log, progress = (lambda line: None), None
    # W&B: None without WANDB_PROJECT; ConfigError if wandb is missing. Rank 0 alone logs.
    sink = wandb_sink.from_environ(os.environ) if distributed.is_main() else None
    run_dir = dp.shared_run_dir(plan.new_run_dir)
    writer = RunWriter(run_dir, sink=sink) if distributed.is_main() else dp.NullWriter()
    writer.write_metadata(config.to_dict(), plan.sources, list(argv), plan.dataset,
                          resumed_from=None if resume is None else resume.record(),
                          world_size=plan.layout.world_size)
    log(f"[run] {run_dir}" + ("" if resume is None else f" (resumed from {resume.checkpoint.path})"))
    for line in plan.placement:
        log(f"[placement] {line}")
    for line in format_plan(plan.memory) if plan.memory is not None else ():
        log(f"[memory] {line}")
    for line in plan.data_lines:  # the first names the data: source (or cache file), rows, fingerprint
        log(f"[data] {line}")
    seed_everything(config.seed, config.deterministic)
    owned = None  # a service made here is closed here (a vLLM sampler's server stops with it)
    try:
        if resume is not None:
            resume.begin(writer)
        service = service_factory() if service_factory is not None else (owned := default_service(
            config.backend, plan.memory, concurrent_sampling=config.off_policy > 0))
        training = training_client(service, config)
        tokenizer = training.get_tokenizer()
        check_prompts(tokenizer, task, plan.problems, plan.rollout.prompt_limit, plan.paradigm.prompt_suffixes, log)
        judge = plan.judge.build(service, tokenizer)

        def validate(steps_done: int) -> None:  # rank 0 alone validates (and writes); no collective inside
            if distributed.is_main():
                plan.validator(steps_done, training, tokenizer, writer, log)

        in_flight = {}  # an asynchronous run resumed: the snapshots its next batches are sampled from
        if resume is not None and config.off_policy > 0:
            in_flight = restore_samplers(training, resume.checkpoint.sampler_adapters or {}, resume.step,
                                         config.off_policy)
        first = 0 if resume is None else resume.restore(training)  # a resumed run has copied its validation rows
        cursor = DataCursor() if resume is None else resume.cursor()
        if evaluate is not None:
            evaluate("initial", training, tokenizer)
        if first == 0:
            validate(0)
        steps = range(first, config.steps) if progress is None else progress(range(first, config.steps))
        if config.off_policy > 0:  # asynchronous: batches sampled ahead on a rollout thread (off_policy.py)
            def validate_with(steps_done: int, snapshot) -> None:
                if distributed.is_main():
                    plan.validator(steps_done, snapshot, tokenizer, writer, log)

            run_off_policy(plan, steps, first, training, tokenizer, judge, writer, log, cursor, in_flight,
                           validate_with, run_dir_checkpointer(plan, training, run_dir, log))
        for step in steps if config.off_policy == 0 else ():
            pending_signal.raise_pending()  # a signal that a library swallowed stops the run here
            one_step(plan, step, training, tokenizer, judge, writer, log, cursor)
            validate(step + 1)
            # after validation: a checkpoint at step k implies its validation row (every rank takes part in
            # gathering a sharded state; rank 0 writes)
            plan.checkpoints.save_if_due(training, run_dir, step + 1, cursor, log)
        if evaluate is not None:
            evaluate("final", training, tokenizer)
        writer.write_report()
        writer.finish("completed")
        outcome = "success"
    except KeyboardInterrupt as interrupt:
        outcome = "interrupted"
        raise interrupted(run_dir, writer, owned, interrupt, log) from None
    except BaseException as error:
        outcome = "errored"
        writer.finish("failed", error=f"{type(error).__name__}: {error}")
        raise
    finally:
        if owned is not None and callable(getattr(owned, "close", None)):
            owned.close(outcome)  # the SDK's ServiceClient.close(status) takes the session's outcome
    distributed.barrier()  # the other ranks return the directory only once rank 0 has completed it
    return run_dir
