"""The training loop: sample → score → advantages → datums → forward_backward → optim_step → sync → log.

It talks only to the Tinker-style clients, so it runs on the local backend and on the hosted
service alike. Everything a run can get wrong in its options or data fails before a model loads;
a run that fails later is marked ``failed`` in its metadata, so its directory never passes the rubric.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tinker import types

from rlrunbook import distributed
from rlrunbook.errors import ConfigError, RunInterrupted
from rlrunbook.rl import data_parallel as dp
from rlrunbook.rl.checkpointing import plan_resume, save_if_due
from rlrunbook.rl.config import TrainConfig, validate
from rlrunbook.rl.dataset_cache import load_problems
from rlrunbook.rl.dynamic_sampling import DataCursor, SampledStep, count_skip, sample_step, skip_reason
from rlrunbook.rl.guards import PromptLimit, check_mismatch, check_prompts, finite_optim_step
from rlrunbook.rl.judges import Judge, MockJudge, ModelJudge
from rlrunbook.rl.paradigms import RolloutContext, get_paradigm
from rlrunbook.rl.preflight import dataset_record, preflight
from rlrunbook.rl.rollouts import advantage_mode, step_record, to_datum
from rlrunbook.rl.tasks import Problem, get_task_class
from rlrunbook.rl.validation import Validator, check_held_out, split_held_out
from rlrunbook.run import RunWriter, log_root, new_run_dir, wandb_sink

# forward_backward metrics logged in every train_log row (the offline GRPO trainer's names), when reported:
# the loss split into its policy-gradient, KL and entropy terms, the KL to the reference and the entropy
# (when those terms are on), the fraction of clipped importance ratios, and the sampler-trainer mismatch.
TRAINER_METRICS = {
    "loss_pg:sum": "loss_pg", "loss_kl:sum": "loss_kl", "loss_entropy:sum": "loss_entropy",
    "kl_divergence:mean": "kl_divergence", "entropy:mean": "entropy", "clip_fraction:mean": "clip_fraction",
    "mismatch/abs_logprob_diff:mean": "mismatch/abs_logprob_diff", "mismatch/kl:mean": "mismatch/kl",
    "mismatch/corrected_fraction:mean": "mismatch/corrected_fraction",
}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}


def _order(problems: list[Problem], seed: int) -> list[int]:
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    return order


def _build_judge(config: TrainConfig, service, tokenizer) -> Judge | None:
    if config.mode != "debate":
        return None
    if config.mock_judge:
        return MockJudge()
    sampler = service.create_sampling_client(base_model=config.judge_model or config.model)
    return ModelJudge(sampler, sampler.get_tokenizer() if config.judge_model else tokenizer)


def _training_device(config: TrainConfig) -> str | None:
    """The device the local backend will train on (torchrun ranks join a group on it); None: the default."""
    from rlrunbook.backend import backend_name

    return local_settings(config).device if backend_name() == "local" else None


def _is_local(training) -> bool:
    """Whether ``training`` is this project's local backend (which takes the local loss_fn_config keys)."""
    from rlrunbook.backend.training_client import LocalTrainingClient

    return isinstance(training, LocalTrainingClient)


def _memory_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB
    return round(peak, 1)


def prepare(config: TrainConfig):
    """Validate options and load the data set: every user error surfaces here, before any model loads."""
    config = validate(config)
    if config.mismatch.correction != "none":
        from rlrunbook.backend import backend_name

        if backend_name() != "local":
            raise ConfigError(f"mismatch.correction={config.mismatch.correction} is a local-backend extension; the "
                              "hosted service (TINKER_BACKEND=api) does not know it. Drop it or train locally.")
    paradigm = get_paradigm(config.mode)
    weights = config.reward
    options = {"summary_max_words": config.summary_max_words, "verify_weight": weights.verify_weight,
               "format_weight": weights.format_weight, "reflect_weight": weights.reflect_weight, **config.extra}
    task = get_task_class(config.env)(config.dataset, config.reward_fn, config.seed, options)
    problems = load_problems(task, config.data)  # task.load(), or its --cache-dataset copy
    check_held_out(config.validation, len(problems))
    if config.expected_dataset_hash is not None:
        actual = task.dataset_info(problems).get("fingerprint")
        if actual != config.expected_dataset_hash:
            raise ConfigError(
                f"data set {task.dataset!r} has fingerprint {actual}, not the expected {config.expected_dataset_hash}: "
                "it changed since that hash was recorded. Use the recorded data, or drop --expected-dataset-hash "
                "to accept the new one (run_metadata.json records it)."
            )
    return config, paradigm, task, problems


def local_settings(config: TrainConfig):
    """The local backend's settings: the TINKER_LOCAL_* environment, with the run's ``backend`` section on top."""
    import dataclasses

    import torch

    from rlrunbook.backend.settings import LocalSettings

    settings = LocalSettings.from_env()
    stated = config.backend
    changes: dict[str, object] = {"load_in_4bit": stated.load_in_4bit}
    if stated.device is not None:
        changes["device"] = stated.device
    if stated.dtype is not None:
        changes["dtype"] = getattr(torch, stated.dtype)
    if stated.grad_accum_steps is not None:
        changes["grad_accum_chunks"] = stated.grad_accum_steps
    if stated.sampler is not None:
        changes["sampler"] = stated.sampler
    return dataclasses.replace(settings, **changes)


def _default_service(config: TrainConfig):
    from rlrunbook.backend import backend_name, create_service_client

    if backend_name() == "local":
        return create_service_client(settings=local_settings(config))
    return create_service_client()


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, NumPy and torch; with ``deterministic``, make torch refuse nondeterministic kernels."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        if torch.cuda.is_available():
            torch.backends.cudnn.benchmark = False


def run_training(config: TrainConfig, *, service_factory: Callable[[], object] | None = None,
                 argv: Sequence[str] = (), config_sources: dict[str, str] | None = None,
                 log: Callable[[str], None] = print, progress: Callable | None = None,
                 evaluate: Callable[[str, object, object], None] | None = None,
                 resume_from: str | Path | None = None) -> Path:
    """Run ``config`` and return its run directory (see DESIGN §5 for the files it holds).

    ``evaluate(label, training_client, tokenizer)``, if given, is called with ``"initial"`` before
    the first step and ``"final"`` after the last: the hook for held-out evaluation.
    ``resume_from`` (a run directory or one of its checkpoints) continues that run in a new run
    directory, with the checkpoint's config (see :mod:`rlrunbook.rl.checkpointing`).

    Under ``torchrun`` (see :mod:`rlrunbook.rl.data_parallel`) every process samples and trains
    its block of each step's groups; rank 0 alone creates and writes the run directory (and its
    checkpoints) and logs, and every rank returns its path once rank 0 has finished it.
    """
    resume = None if resume_from is None else plan_resume(resume_from, config, config_sources)
    if resume is not None:
        config, config_sources = resume.config, resume.sources
    config, paradigm, task, problems = prepare(config)
    if resume is not None:
        resume.check_dataset(task.dataset_info(problems))
    preflight(config)  # log root, name, backend, device, model folders: before any model and any run directory
    dataset, data_warnings = dataset_record(task, problems)
    layout = distributed.launch_layout()
    dp.check_divisible(config.num_groups, layout.world_size)
    distributed.init(layout, device=_training_device(config))
    if not distributed.is_main():
        log, progress = (lambda line: None), None
    advantages_of = advantage_mode(config.run_mode)
    # W&B: None without WANDB_PROJECT; ConfigError if wandb is missing. Rank 0 alone logs.
    sink = wandb_sink.from_environ(os.environ) if distributed.is_main() else None
    run_dir = dp.shared_run_dir(
        lambda: new_run_dir(log_root(config.log_root), config.run_mode, config.env, config.name))
    writer = RunWriter(run_dir, sink=sink) if distributed.is_main() else dp.NullWriter()
    writer.write_metadata(config.to_dict(), config_sources or {}, list(argv), dataset,
                          resumed_from=None if resume is None else resume.record(), world_size=layout.world_size)
    log(f"[run] {run_dir}" + ("" if resume is None else f" (resumed from {resume.checkpoint.path})"))
    for line in data_warnings:
        log(f"[data] {line}")
    if task.cache_info is not None:
        log(f"[data] {task.cache_info['status']} the cached data set {task.cache_info['path']}")
    seed_everything(config.seed, config.deterministic)
    owned = None  # a service made here is closed here (a vLLM sampler's server stops with it)
    try:
        if resume is not None:
            resume.begin(writer)
        service = service_factory() if service_factory is not None else (owned := _default_service(config))
        training = service.create_lora_training_client(config.model, rank=config.lora_rank, seed=config.seed,
                                                       train_unembed=config.train_unembed)
        tokenizer = training.get_tokenizer()
        limit = PromptLimit.from_settings(config.data)
        check_prompts(tokenizer, task, problems, limit, paradigm.prompt_suffixes, log)
        judge = _build_judge(config, service, tokenizer)
        # With validation on, the last validation.num_problems of the seeded order are held out of training.
        problems, order, held_out = split_held_out(problems, _order(problems, config.seed), config.validation)
        validator = Validator(config, task, held_out, writer, log)
        if not distributed.is_main():  # rank 0 alone validates (and writes); no collective happens inside
            validator = lambda *args: None  # noqa: E731
        first = 0 if resume is None else resume.restore(training)  # a resumed run has copied its validation rows
        cursor = DataCursor() if resume is None else resume.cursor()
        if evaluate is not None:
            evaluate("initial", training, tokenizer)
        if first == 0:
            validator(0, training, tokenizer)
        steps = range(first, config.steps) if progress is None else progress(range(first, config.steps))
        for step in steps:
            _one_step(config, step, paradigm, task, problems, order, training, tokenizer, judge,
                      advantages_of, writer, log, cursor)
            validator(step + 1, training, tokenizer)
            if distributed.is_main():  # after validation: a checkpoint at step k implies its validation row
                save_if_due(config, training, run_dir, step + 1, log, cursor)
        if evaluate is not None:
            evaluate("final", training, tokenizer)
        writer.write_report()
        writer.finish("completed")
    except KeyboardInterrupt as interrupt:
        raise _interrupted(run_dir, writer, owned, interrupt, log) from None
    except BaseException as error:
        writer.finish("failed", error=f"{type(error).__name__}: {error}")
        raise
    finally:
        if owned is not None and callable(getattr(owned, "close", None)):
            owned.close()
    distributed.barrier()  # the other ranks return the directory only once rank 0 has completed it
    return run_dir


def _interrupted(run_dir: Path, writer: RunWriter, service, interrupt: KeyboardInterrupt, log) -> RunInterrupted:
    """Ctrl-C (or SIGTERM) in a run: mark it ``interrupted`` at once, then stop the backend's worker thread
    (queued calls cancelled, the running one finished) so the process can exit without the C++ runtime
    aborting under a thread still inside torch. Checkpoints are written atomically, so the last complete
    one is intact whatever the interrupt cut short. A second Ctrl-C stops waiting for the running call."""
    from rlrunbook.run.checkpoints import checkpoint_dirs

    name = getattr(interrupt, "signal_name", "SIGINT")
    found = checkpoint_dirs(run_dir) if distributed.is_main() else []
    last = found[-1][1] if found else None
    writer.finish("interrupted", error=f"{name}: stopped by the user; last checkpoint: {last or 'none'}")
    stopped = True
    stop_now = getattr(service, "stop_now", None)
    if callable(stop_now):
        log("[interrupt] stopping: waiting for the backend's running call to end (Ctrl-C again to exit at once)")
        try:
            stopped = stop_now()
        except KeyboardInterrupt:
            stopped = False
    return RunInterrupted(run_dir, last, stopped, name)


def _sample(config, step, paradigm, task, problems, order, training, tokenizer, judge, advantages_of, log,
            cursor: DataCursor) -> SampledStep:
    """Sample the step's groups with dynamic sampling (tied groups replaced; see rl/dynamic_sampling.py)."""
    sampler = training.save_weights_and_get_sampling_client()

    def rollout(chosen, group_ids):
        ctx = RolloutContext(sampler, tokenizer, task, config, [tokenizer.eos_token_id], judge, log,
                             group_ids=group_ids)
        return paradigm.rollout(ctx, chosen, step)

    return sample_step(config, step, cursor, problems, order, rollout, advantages_of, log)


def _skip_step(config, step: int, sampled: SampledStep, writer: RunWriter, log, cursor: DataCursor,
               started: float) -> None:
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
        **sampled.metrics(), "num_datums": 0, "num_trained_tokens": 0,
        "completion_length/mean": statistics.fmean(r.own_token_count for r in batch.rollouts),
        "time/sample_s": done - started - batch.metrics.get("time/score_s", 0.0),
        "time/score_s": batch.metrics.get("time/score_s", 0.0), "time/step_s": done - started,
        "throughput/sampled_tokens_per_s": batch.sampled_tokens / max(1e-9, done - started),
        "memory/rss_mb": _memory_mb(),
    })
    log(f"warning: step {step} skipped, no update: {reason}. {cursor.skipped_in_a_row} step(s) skipped in a row; "
        f"the run stops at {config.dynamic_sampling.max_skipped_steps}.")


def _one_step(config, step, paradigm, task, problems, order, training, tokenizer, judge, advantages_of,
              writer: RunWriter, log, cursor: DataCursor) -> None:
    started = time.perf_counter()
    sampled = _sample(config, step, paradigm, task, problems, order, training, tokenizer, judge, advantages_of,
                      log, cursor)
    batch = sampled.drawn
    sampled_at = time.perf_counter()
    writer.write_rollouts(batch.kind, step, batch.payload)
    if sampled.skipped:
        _skip_step(config, step, sampled, writer, log, cursor, started)
        return
    cursor.skipped_in_a_row = 0
    advantages = sampled.advantages
    chosen = [(r, a) for r, a in zip(sampled.kept, advantages, strict=True) if a != 0]
    log(f"Training data: {len(chosen)} datums from {len(batch.rollouts)} rollouts")
    datums = [to_datum(r, a) for r, a in dp.own_share(chosen, sampled.own_groups)]
    loss_config = config.loss_fn_config(local=_is_local(training)) or None
    fb = training.forward_backward(datums, config.loss_fn, loss_config).result() if datums else None
    fb_done = time.perf_counter()
    single = distributed.world_size() == 1
    if single and fb is not None:  # before optim_step: a refused step leaves the weights unchanged
        check_mismatch(step, fb.metrics, config.mismatch, config.temperature, writer, log)
    # A NaN/inf loss or gradient norm is refused before it reaches the weights (rl/guards.py). Every rank
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
        "advantage/nonzero_count": len(nonzero),
        "advantage/nonzero_fraction": len(nonzero) / len(advantages),
        "advantage/min": min(advantages), "advantage/max": max(advantages),
        "loss/sum": loss, "num_datums": len(chosen), "num_trained_tokens": trained,
        **{name: float(fb_metrics[key]) for key, name in TRAINER_METRICS.items() if key in fb_metrics},
        "completion_length/mean": statistics.fmean(lengths),
        "grad_norm": float((optim.metrics or {}).get("grad_norm:mean", float("nan"))),
        "time/sample_s": sampled_at - started - batch.metrics.get("time/score_s", 0.0),
        "time/score_s": batch.metrics.get("time/score_s", 0.0),
        "time/forward_backward_s": fb_done - sampled_at, "time/optim_s": done - fb_done, "time/step_s": done - started,
        "throughput/sampled_tokens_per_s": batch.sampled_tokens / max(1e-9, sampled_at - started),
        "throughput/trained_tokens_per_s": trained / max(1e-9, done - sampled_at),
        "memory/rss_mb": _memory_mb(),
        **{k: v for k, v in batch.metrics.items() if k != "time/score_s"},
        **sampled.metrics(),
    }
    writer.log_step({k: v for k, v in row.items() if v == v})  # drop NaN (no grad_norm reported)
    log(f"Step {step}: reward {rewards['mean']:.4f} (task {task_rewards['mean']:.4f}), "
        f"Advantage stats (nonzero): count {len(nonzero)}, min {min(nonzero):.4f}, max {max(nonzero):.4f}")
    log(f"Loss: {loss:.4f}  Tokens: {trained}  step {done - started:.1f}s")
