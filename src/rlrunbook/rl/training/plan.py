"""A run resolved once, before any model loads: the :class:`RunPlan` that the training loop consumes.

:func:`plan_run` reads the run's config in one place: the resume point (a checkpoint's config replaces
the one given), the validated options, the task, paradigm and data set, the checks of the run's
surroundings (log root, backend, device, model folders), the data-parallel layout, the problem order and
held-out split, and what each stage below receives of the config: the rollout settings, the judge, the
validator and the checkpoint schedule. The loop reads the plan; the modules it calls get those parts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlrunbook import distributed
from rlrunbook.rl.evaluation.validation import Validator
from rlrunbook.rl.rollout.judges import JudgeChoice
from rlrunbook.rl.rollout.paradigms import Paradigm, RolloutSettings
from rlrunbook.rl.rollout.rollouts import Rollout, advantage_mode
from rlrunbook.rl.rollout.tasks import Problem, Task
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.data_order import problem_order, split_held_out
from rlrunbook.rl.setup.memory_plan import MemoryPlan, check_fits, plan_memory
from rlrunbook.rl.setup.placement import placement, resolved_sampler
from rlrunbook.rl.setup.preflight import preflight
from rlrunbook.rl.setup.prepare import dataset_record, prepare
from rlrunbook.rl.setup.resume import CheckpointSchedule, Resume, plan_resume
from rlrunbook.rl.setup.service import training_device
from rlrunbook.rl.training import data_parallel as dp


@dataclass(frozen=True)
class RunPlan:
    """Everything a training run is, resolved before any model loads or any run directory exists."""

    config: TrainConfig  # validated; a resumed run's is its checkpoint's (with steps, name, log_root as given)
    sources: dict[str, str]  # where each config value came from (run_metadata.json)
    resume: Resume | None  # the checkpoint a resumed run continues from
    task: Task
    paradigm: Paradigm
    problems: list[Problem]  # the whole data set, as loaded (every prompt is measured against the limit)
    dataset: dict  # what run_metadata.json records of the data set
    data_lines: list[str]  # lines to log about the data set: what it is, then notices and warnings
    training_problems: list[Problem]  # those trained on (validation holds the others out) ...
    order: list[int]  # ... and the seeded order in which they are drawn
    rollout: RolloutSettings  # what paradigms and validation read of the config
    judge: JudgeChoice
    validator: Validator
    checkpoints: CheckpointSchedule
    advantages_of: Callable[[Sequence[Rollout]], list[float]]  # the training mode's advantages
    layout: distributed.Layout = field(default_factory=distributed.Layout)  # the torchrun launch
    device: str | None = None  # the local backend's training device (None: the default, or another backend)
    placement: list[str] = field(default_factory=list)  # what runs where (rl/setup/placement.py), logged first
    memory: MemoryPlan | None = None  # the local backend's memory plan (rl/setup/memory_plan.py); None for api

    def new_run_dir(self) -> Path:
        """Create this run's directory: ``<log root>/<timestamp>_<mode>_<env>_<name>``."""
        from rlrunbook.run import log_root, new_run_dir

        config = self.config
        return new_run_dir(log_root(config.log_root), config.run_mode, config.env, config.name)


def check_off_policy(config: TrainConfig, backend: str, world_size: int) -> None:
    """Refuse, before any model loads, what an asynchronous run (``off_policy`` > 0) does not support yet."""
    from rlrunbook.errors import ConfigError

    if config.off_policy == 0:
        return
    if world_size > 1:
        raise ConfigError(f"--off-policy {config.off_policy} under torchrun ({world_size} processes): asynchronous "
                          "training is single-process for now. Run one process, or --off-policy 0.")
    if backend != "local":
        raise ConfigError(f"--off-policy {config.off_policy} with TINKER_BACKEND={backend}: the lag's measures and "
                          "the importance correction (mismatch.correction) are local-backend extensions. Use "
                          "TINKER_BACKEND=local, or --off-policy 0.")
    if config.off_policy >= config.steps:
        raise ConfigError(f"--off-policy {config.off_policy} is not below -s {config.steps}: every batch would be "
                          "sampled from the initial weights. Use a smaller K (1 or 2 is typical) or more steps.")


def check_full_sampler(config: TrainConfig, env: Mapping[str, str]) -> None:
    """Refuse, before the data set loads, a sampler that full-parameter training cannot use as the environment
    sets it: ``TINKER_LOCAL_SAMPLER=generate``, or a vLLM server of the user's (``TINKER_LOCAL_VLLM_URL``)."""
    from rlrunbook.errors import ConfigError

    if config.finetune != "full":
        return
    sampler, _ = resolved_sampler(config.backend, env)
    if sampler == "generate":  # backend.sampler generate is refused with the options
        raise ConfigError("TINKER_LOCAL_SAMPLER=generate with finetune full: full-parameter training samples with "
                          "the in-process engine or a vLLM server. Set TINKER_LOCAL_SAMPLER=hf or vllm.")
    if sampler == "vllm" and env.get("TINKER_LOCAL_VLLM_URL", "").strip():
        raise ConfigError("TINKER_LOCAL_VLLM_URL with finetune full: full-parameter training replaces the vLLM "
                          "server's weights after every step, so it starts a server of its own. Unset "
                          "TINKER_LOCAL_VLLM_URL.")


def judge_choice(config: TrainConfig) -> JudgeChoice:
    """The judge of a debate run (mock, or a model judge of ``judge_model``, default the policy's base model)."""
    if config.mode != "debate":
        return JudgeChoice("none")
    if config.mock_judge:
        return JudgeChoice("mock")
    return JudgeChoice("model", config.judge_model or config.model, own_tokenizer=bool(config.judge_model))


def plan_run(config: TrainConfig, *, resume_from: str | Path | None = None,
             sources: dict[str, str] | None = None) -> RunPlan:
    """Resolve ``config`` (and, with ``resume_from``, the checkpoint it continues) into a :class:`RunPlan`.

    Every mistake in the options, the data, the surroundings or the checkpoint is raised here, before any
    model loads and before a run directory exists.
    """
    resume = None if resume_from is None else plan_resume(resume_from, config, sources)
    if resume is not None:
        config, sources = resume.config, resume.sources
    # Log root, name, backend, device, model folders: before any model, any run directory and the data set, so
    # a model that cannot be had is named as such, not as the data set's connection error on a machine offline.
    preflight(validate(config))
    check_full_sampler(config, os.environ)
    config, paradigm, task, problems = prepare(config)
    if resume is not None:
        resume.check_dataset(task.dataset_info(problems))
    from rlrunbook.backend import backend_name

    layout = distributed.launch_layout()
    memory = None
    if backend_name() == "local":  # refused here when it cannot fit, naming the knob; a full fine-tune per rank
        memory = plan_memory(config, world_size=layout.world_size)
        check_fits(memory)
    dataset, data_lines = dataset_record(task, problems)
    dp.check_divisible(config.num_groups, layout.world_size)
    check_off_policy(config, backend_name(), layout.world_size)
    # With validation on, the last validation.num_problems of the seeded order are held out of training.
    training_problems, order, held_out = split_held_out(problems, problem_order(problems, config.seed),
                                                        config.validation)
    rollout = config.rollout_settings()
    return RunPlan(
        config=config, sources=dict(sources or {}), resume=resume, task=task, paradigm=paradigm, problems=problems,
        dataset=dataset, data_lines=data_lines, training_problems=training_problems, order=order,
        rollout=rollout, judge=judge_choice(config),
        validator=Validator(task, held_out, config.validation, rollout, config.seed, config.steps),
        checkpoints=CheckpointSchedule.of(config), advantages_of=advantage_mode(config.run_mode),
        layout=layout, device=training_device(config.backend), placement=placement(config.backend, os.environ),
        memory=memory)
