"""Options that apply only in some settings: null until they apply, their default then, refused where ignored.

An option that the chosen mode, loss or setting ignores (``--kl-estimator k3`` with the KL off,
``--lora-rank 64`` with ``finetune: full``,
``--val-samples 8`` with validation off, ``--judge-model`` in a single-turn run, ``--summary-max-words`` in a
qa run) is listed here with the setting that reads it. Its field defaults to null ("not set"), so the defaults, the presets and ``--strict-config``
files never state an option that does nothing; :func:`settle` (called by
:func:`~rlrunbook.rl.setup.config_checks.validate`) fills the
documented default of an option that applies and was left null, and refuses one that was set where
nothing reads it, naming the setting that would. The options a task reads through a config field
(``summary_max_words``, ``reward.*_weight``) apply where the task declares them
(:mod:`rlrunbook.rl.rollout.task_options`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.task_options import TaskOption
from rlrunbook.rl.rollout.tasks import TASKS, get_task_class
from rlrunbook.rl.setup.flags import named
from rlrunbook.rl.setup.limits import shown

CLIP_LOSSES = ("ppo", "cispo", "gspo")  # the losses that read loss.clip_low_threshold / clip_high_threshold


@dataclass(frozen=True)
class Conditional:
    """A config option read only in some settings: ``applies(config)``; ``needs`` says which, ``now(config)``
    what this config has instead. ``default`` is what null means once it applies (None: it stays null)."""

    key: str
    default: Any
    applies: Callable[[Any], bool]
    needs: str
    now: Callable[[Any], str]


def _validation(key: str, default: Any) -> Conditional:
    return Conditional(key, default, lambda c: c.validation.every > 0,
                       "with validation on (--val-every above 0)", lambda c: "validation.every is 0")


def _mismatch(key: str, default: float, correction: str) -> Conditional:
    return Conditional(key, default, lambda c: c.mismatch.correction == correction,
                       f"with mismatch.correction {correction}",
                       lambda c: f"mismatch.correction is {c.mismatch.correction}")


def _clip(key: str) -> Conditional:
    return Conditional(key, None, lambda c: c.loss_fn in CLIP_LOSSES,
                       "to the clipped losses (--loss-fn ppo, cispo or gspo)", lambda c: f"--loss-fn is {c.loss_fn}")


def _judge_now(config: Any) -> str:
    if config.mode != "debate":
        return f"the mode is {config.mode}"
    return "--mock-judge is set, and the mock judge reads no model"


def _lora(key: str, default: Any) -> Conditional:
    return Conditional(key, default, lambda c: c.finetune == "lora", "to LoRA training (finetune: lora)",
                       lambda c: f"finetune is {c.finetune}")


CONDITIONALS: tuple[Conditional, ...] = (
    _lora("lora_rank", 16),
    _lora("train_unembed", True),
    Conditional("loss.kl_estimator", "low_var_kl",
                lambda c: c.loss.kl_coef > 0, "with the KL term on (--kl-coef above 0)",
                lambda c: "loss.kl_coef is 0"),
    _clip("loss.clip_low_threshold"),
    _clip("loss.clip_high_threshold"),
    _mismatch("mismatch.cap", 2.0, "truncate"),
    _mismatch("mismatch.mask_low", 0.125, "mask"),
    _mismatch("mismatch.mask_high", 8.0, "mask"),
    _validation("validation.samples", 4),
    _validation("validation.num_problems", 16),
    _validation("validation.threshold", 1.0),
    Conditional("judge_model", None,
                lambda c: c.mode == "debate" and not c.mock_judge,
                "to debates judged by a model (--mode debate without --mock-judge)", _judge_now),
    Conditional("data.cache_dir", None, lambda c: c.data.cache,
                "with the data set cache on (--cache-dataset)", lambda c: "data.cache is false"),
)

# Config fields that feed a task option (TaskOption.field).
TASK_FIELDS = ("summary_max_words", "reward.verify_weight", "reward.format_weight", "reward.reflect_weight")


def _get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _task_option(config: Any, key: str) -> TaskOption | None:
    task = get_task_class(config.env)
    return next((option for option in task.declared_options.values() if option.field == key), None)


def _task_conditional(config: Any, key: str) -> Conditional:
    """The conditional of a task-fed field: it applies where the run's task declares it and reads it."""
    option = _task_option(config, key)
    task = get_task_class(config.env)
    dataset = config.dataset or task.default_dataset
    reward_fn = config.reward_fn or task.reward_fns[0]
    if option is None:
        readers = sorted(name for name, cls in TASKS.items()
                         if any(o.field == key for o in cls.declared_options.values()))
        return Conditional(key, None, lambda c: False,
                           f"to the tasks that read it ({', '.join(f'--env {r}' for r in readers) or 'none'})",
                           lambda c: f"--env is {c.env}")
    return Conditional(key, option.default, lambda c: option.applies(dataset, reward_fn),
                       f"with {option.needs()}", lambda c: f"this run has --dataset {dataset} with --reward-fn "
                                                           f"{reward_fn}")


def _all(config: Any) -> list[Conditional]:
    """Every conditional of ``config``; the task-fed ones only where its task is registered (a stored config
    of a plug-in task that is not loaded now keeps those values as recorded)."""
    tasks = [_task_conditional(config, key) for key in TASK_FIELDS] if config.env in TASKS else []
    return [*CONDITIONALS, *tasks]


def settle(config: Any) -> dict[str, Any]:
    """The dotted keys to fill (an option that applies, left null: its default) for ``config`` (a
    ``TrainConfig`` whose ``env`` is registered); ``ConfigError`` for an option set where nothing reads it."""
    fills: dict[str, Any] = {}
    for conditional in _all(config):
        value = _get(config, conditional.key)
        if conditional.applies(config):
            if value is None and conditional.default is not None:
                fills[conditional.key] = conditional.default
        elif value is not None:
            raise ConfigError(f"{named(conditional.key)} {shown(value)} has no effect in this run: it applies only "
                              f"{conditional.needs}, but {conditional.now(config)}. Drop it, or change that "
                              "setting.")
    return fills


def inapplicable(config: Any) -> list[str]:
    """The dotted keys of ``config`` set where nothing reads them. Records of runs made before these options
    became null when unused hold their old defaults there (``loss.kl_estimator: low_var_kl`` with the KL
    off); ``TrainConfig.from_stored`` nulls them, as they had no effect in that run either."""
    return [c.key for c in _all(config) if not c.applies(config) and _get(config, c.key) is not None]
