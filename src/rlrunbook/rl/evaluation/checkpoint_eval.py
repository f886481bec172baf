"""``rlrunbook eval-checkpoints``: every checkpoint of a run, scored on held-out problems, one row per step.

Each checkpoint's adapter is imported into one LoRA training client built like the run's (model, rank)
and sampled through ``save_weights_and_get_sampling_client()``: no training step, no storage folder.
Step 0 is that client before any import: the run's initial adapter, whose B matrices are zero, so it
computes exactly what the base model computes.

Held-out problems: by default those of the run's data set that its problem order never reached up to
the last checkpoint's data cursor (the order is a pure function of the seed, so this is exact); ``dataset`` evaluates on
another data set instead. Every checkpoint answers the same problems with the same sampling seeds
(common random numbers), so differences between rows come from the weights, not from the draw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.tasks import Problem, get_task_class
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.data_order import problem_order
from rlrunbook.run.checkpoint_format import checkpoint_dirs, load_checkpoint, verify_checkpoint


@dataclass(frozen=True)
class EvalOptions:
    """What ``eval-checkpoints`` samples and reports."""

    samples: int = 8
    num_problems: int = 16
    ks: tuple[int, ...] = (1, 4, 8)
    threshold: float = 1.0
    confidence: float = 0.95
    resamples: int = 2000
    include_base: bool = True
    dataset: str | None = None


def table_columns(ks: Sequence[int]) -> list[str]:
    columns = ["step", "mean_reward", "mean_ci_low", "mean_ci_high"]
    for k in sorted(set(ks)):
        columns += [f"pass@{k}", f"pass@{k}_ci_low", f"pass@{k}_ci_high"]
    return columns


def held_out_problems(config: TrainConfig, problems: list[Problem], drawn: int | None = None) -> list[Problem]:
    """The problems training never drew, in the run's (seeded) order.

    ``drawn``: how many problems the run drew, the data cursor of its last checkpoint (dynamic sampling
    draws more than ``num_groups`` per step when it replaces tied groups); default ``steps * num_groups``,
    which is exact for checkpoints made before dynamic sampling.
    """
    order = problem_order(problems, config.seed)
    count = config.steps * config.num_groups if drawn is None else drawn
    taken = {order[i % len(problems)] for i in range(min(count, len(problems)))}
    return [problems[i] for i in order if i not in taken]


def _row(step: int, summary) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "mean_reward": summary.mean_reward,
                           "mean_ci_low": summary.mean_ci[0], "mean_ci_high": summary.mean_ci[1]}
    for k, value in summary.pass_at.items():
        row.update({f"pass@{k}": value, f"pass@{k}_ci_low": summary.pass_ci[k][0],
                    f"pass@{k}_ci_high": summary.pass_ci[k][1]})
    return row


def checkpoint_samplers(training, folders: Sequence[Path], include_base: bool = True) -> Iterator[tuple[int, Any]]:
    """``(step, sampling client)`` for step 0 (with ``include_base``) and each checkpoint folder, in order.

    ``training`` is a fresh local training client made as the run made its own (LoRA of the run's rank, or
    full-parameter); each checkpoint's weights are imported into it (no training step) before its sampling
    client is made. A LoRA client samples its own copy of the adapter, so an earlier client stays valid after
    later imports; a full-parameter one samples the live weights, so each is used before the next import.
    """
    from rlrunbook.backend.trainer import TrainingState

    if include_base:
        yield 0, training.save_weights_and_get_sampling_client().result()
    for folder in folders:
        checkpoint = load_checkpoint(folder)
        training.import_training_state(TrainingState(checkpoint.adapter, None, checkpoint.weights_version),
                                       with_optimizer=False)
        yield checkpoint.step, training.save_weights_and_get_sampling_client().result()


def evaluate_checkpoints(run_dir: str | Path, options: EvalOptions = EvalOptions(), *,
                         service_factory: Callable[[TrainConfig], object] | None = None,
                         log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per checkpoint of ``run_dir`` (and step 0 with ``include_base``), by step; see the module docstring.

    Every checkpoint is verified and every option checked before a model loads.
    """
    from rlrunbook.rl.evaluation.evaluate import rewards_per_problem
    from rlrunbook.rl.evaluation.passk import pass_at_k, summarize_eval
    from rlrunbook.rl.rollout.paradigms import RolloutContext
    from rlrunbook.rl.setup.prepare import prepare
    from rlrunbook.rl.setup.service import default_service, training_client

    found = checkpoint_dirs(run_dir)
    if not found:
        raise ConfigError(f"{run_dir} has no checkpoints (checkpoints/step_<k>/checkpoint.json): train with "
                          "--checkpoint-every N, or pass the run directory that holds them.")
    manifests = [verify_checkpoint(folder) for _, folder in found]
    for k in options.ks:
        pass_at_k(options.samples, 0, k)  # ConfigError for a k above --samples
    config = TrainConfig.from_stored(manifests[-1]["config"])  # the last one's steps cover every checkpoint
    if options.dataset is not None:
        # Options the run's data set read (extra.test_size of the generated set) do not apply to another one.
        declared = get_task_class(config.env).declared_options
        extra = {key: value for key, value in config.extra.items()
                 if key not in declared or declared[key].applies(options.dataset, config.reward_fn)}
        config = config.replace(dataset=options.dataset, extra=extra)
    config, _, task, problems = prepare(config)
    log(f"[data] {task.announcement(problems)}")
    for notice in task.notices:
        log(f"[data] notice: {notice}")
    if service_factory is None:
        from rlrunbook.rl.setup.preflight import preflight

        preflight(config, writes_run_dir=False)  # device, model folder: before the model loads
    drawn = (manifests[-1].get("data_cursor") or {}).get("next_problem")
    pool = problems if options.dataset is not None else held_out_problems(config, problems, drawn)
    if not pool:
        raise ConfigError(f"training drew every one of the {len(problems)} problems of {config.dataset!r}: none is "
                          "held out. Pass --dataset with problems the run did not train on.")
    held_out = pool[:options.num_problems]
    service = service_factory(config) if service_factory is not None else default_service(config.backend)
    training = training_client(service, config.replace(loss=config.loss.model_copy(update={"kl_coef": 0.0})))
    if not hasattr(type(training), "import_training_state"):
        raise ConfigError("eval-checkpoints loads adapters into the local backend (TINKER_BACKEND=local).")
    tokenizer = training.get_tokenizer()
    settings = config.rollout_settings()
    rows = []
    for step, sampler in checkpoint_samplers(training, [folder for _, folder in found], options.include_base):
        ctx = RolloutContext(sampler, tokenizer, task, settings, [tokenizer.eos_token_id])
        log(f"[eval-checkpoints] step {step}: {len(held_out)} problems x {options.samples} samples")
        rewards = rewards_per_problem(ctx, held_out, options.samples, seed=config.seed)
        rows.append(_row(step, summarize_eval(rewards, ks=options.ks, threshold=options.threshold,
                                              confidence=options.confidence, resamples=options.resamples,
                                              seed=config.seed)))
    return rows
