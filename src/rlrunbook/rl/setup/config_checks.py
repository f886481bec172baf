"""Every check of a resolved run config, in one place, run once: :func:`validate`.

Types and bounds are pydantic's, when the config is made (:mod:`rlrunbook.rl.setup.config`). Here, in
order: the schema version, the rules between fields (each naming its fix), the limits of every count and
size (:data:`rlrunbook.rl.setup.limits.LIMITS`), the task and paradigm by name, the ``extra`` keys they
declare, and the options read only in some settings (:mod:`rlrunbook.rl.setup.conditional_options`:
filled where they apply, refused where nothing reads them). A config :func:`validate` returned is
remembered as validated, so every later layer (the run plan, the data preparation, a resume) that
validates it again gets it back at once; a config made any other way is checked in full.
"""

from __future__ import annotations

import weakref
from typing import Any

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.paradigms import get_paradigm_class
from rlrunbook.rl.rollout.task_options import check_extra
from rlrunbook.rl.rollout.tasks import get_task_class
from rlrunbook.rl.setup.conditional_options import settle
from rlrunbook.rl.setup.config import CONFIG_VERSION, TrainConfig
from rlrunbook.rl.setup.flags import named
from rlrunbook.rl.setup.limits import LIMITS, shown, shown_number

# Configs validate() returned, by id (weak: an entry goes with its config, so an id is never reused here).
_VALIDATED: weakref.WeakValueDictionary[int, TrainConfig] = weakref.WeakValueDictionary()


def is_validated(config: TrainConfig) -> bool:
    """Whether ``config`` is a config :func:`validate` returned (this very object)."""
    return _VALIDATED.get(id(config)) is config


def validate(config: TrainConfig) -> TrainConfig:
    """Return ``config`` with defaults filled (reward_fn; debate_train in debate mode; the options that apply
    only in some settings, see :mod:`rlrunbook.rl.setup.conditional_options`), or raise ``ConfigError`` naming rule
    and fix: the rules between fields, the limits of :mod:`rlrunbook.rl.setup.limits`, the ``extra`` keys the
    task and paradigm declare, and options set where nothing reads them."""
    if is_validated(config):
        return config

    def fail(rule: str, fix: str) -> None:
        raise ConfigError(f"{rule}. {fix}")

    if config.version != CONFIG_VERSION:
        fail(f"config version {config.version} is not supported (this rlrunbook reads version {CONFIG_VERSION})",
             "Update the file to the current schema and set version: 1.")
    if config.num_rollouts < 1 or config.num_groups < 1 or config.steps < 1:
        fail(f"-n {shown(config.num_rollouts)}, --num-groups {shown(config.num_groups)}, -s {shown(config.steps)} "
             "must all be >= 1", "Pass positive counts.")
    if not config.learning_rate > 0:
        fail(f"--learning-rate {config.learning_rate} must be > 0", "Use e.g. 1e-4.")
    check_limits(config)  # every count and size within what the code holds and a machine runs
    if config.num_rollouts % config.num_groups:
        fail(f"-n {config.num_rollouts} is not divisible by --num-groups {config.num_groups}",
             f"Every group needs the same size: use -n {config.num_groups * max(1, config.num_rollouts // config.num_groups)}.")
    if config.mode == "single_turn" and config.group_size < 2:
        fail(f"a group of {config.group_size} rollout has no spread to centre (GRPO needs >= 2 per group)",
             "Raise -n or lower --num-groups.")
    if config.mode == "debate":
        if config.group_size % 2:
            fail(f"debate group size {config.group_size} (= n / num_groups) is odd; two rollouts make one debate",
                 "Choose -n and --num-groups so that n / num_groups is even.")
        if config.debate_train == "rs_grpo":
            if config.debate_grpo_reward != "task":
                fail("--debate-train rs_grpo needs a task reward to centre across winners",
                     "Add --debate-grpo-reward task.")
            if config.group_size < 4:
                fail(f"rs_grpo with group size {config.group_size} keeps one winner per group: nothing to centre",
                     "Use n / num_groups >= 4.")
        elif config.debate_grpo_reward is not None:
            fail("--debate-grpo-reward applies to --debate-train rs_grpo only", "Drop it or use rs_grpo.")
        config = config.replace(debate_train=config.debate_train or "rejection")
    elif config.debate_train is not None:
        fail(f"--debate-train {config.debate_train} applies to --mode debate only, but the mode is {config.mode!r}",
             "Drop --debate-train (debate_train: null in a config file), or add --mode debate.")
    elif config.debate_grpo_reward is not None or config.mock_judge:
        fail("--mock-judge and --debate-grpo-reward apply to --mode debate only", "Drop them or use --mode debate.")
    paradigm_class = get_paradigm_class(config.mode)  # ConfigError naming the registered paradigms
    task_class = get_task_class(config.env)  # ConfigError naming the registered tasks
    reward = config.reward_fn or task_class.reward_fns[0]
    if reward not in task_class.reward_fns:
        fail(f"--reward-fn {reward!r} does not apply to --env {config.env}",
             f"Use one of {list(task_class.reward_fns)}.")
    if not config.temperature > 0:
        fail(f"--temperature {config.temperature} must be > 0 for RL (a greedy policy has no spread)",
             "Use 0.7 to 1.0.")
    if config.max_tokens < 1:
        fail(f"--max-tokens {config.max_tokens} must be >= 1", "Pass a positive count.")
    if not 0 <= config.min_p < 1:
        fail(f"--min-p {config.min_p} must be in [0, 1)", "Use 0 to disable it.")
    if config.lora_rank is not None and config.lora_rank < 1:
        fail(f"--lora-rank {config.lora_rank} must be >= 1", "Use e.g. 16.")
    if (not config.name.strip() or any(c in config.name for c in "/\\") or config.name in (".", "..")
            or not config.name.isprintable()):
        fail(f"--name {shown(config.name)} must be a plain name (no path separator, no newline or other control "
             "character: it becomes part of a directory name)", "Use letters, digits, '-' and '_'.")
    low, high = config.loss.clip_low_threshold, config.loss.clip_high_threshold
    if low is not None and high is not None and low >= high:
        fail(f"loss.clip_low_threshold {config.loss.clip_low_threshold} must be below loss.clip_high_threshold "
             f"{config.loss.clip_high_threshold}", "Use e.g. 0.8 and 1.2.")
    if config.data.truncate_prompts and config.data.max_prompt_tokens is None:
        fail("--truncate-prompts needs --max-prompt-tokens", "State the limit the prompts are cut to.")
    if any(not word.strip() for word in config.reward.blocklist):
        fail(f"reward.blocklist {list(config.reward.blocklist)} holds an empty entry, which every completion contains",
             "Drop the empty --blocklist value.")
    if config.reward.reject_blocklisted and not config.reward.blocklist:
        fail("--reject-blocklisted with an empty blocklist rejects nothing", "Add --blocklist WORD (repeatable).")
    if config.backend.load_in_4bit and config.backend.device is not None and not config.backend.device.startswith("cuda"):
        fail(f"backend.load_in_4bit needs a cuda device, not {config.backend.device!r}",
             "Drop load_in_4bit on CPU or run on a GPU.")
    if config.backend.load_in_4bit and config.backend.sampler == "hf":
        fail("backend.load_in_4bit with backend.sampler hf: the in-process engine computes with floating-point "
             "base weights only", "Set backend.sampler: generate (transformers generate on the 4-bit weights) or vllm.")
    if config.backend.load_in_4bit and config.finetune == "full":
        fail("backend.load_in_4bit quantises the frozen base weights of LoRA training, and finetune full trains "
             "every weight (none is frozen)", "Drop load_in_4bit, or set finetune: lora.")
    if config.finetune == "full" and config.off_policy > 0:
        fail(f"--off-policy {config.off_policy} samples batches from past weights, and finetune full keeps no copies "
             "of past weights (a copy of every weight per batch ahead)", "Use --off-policy 0, or finetune: lora.")
    if config.finetune == "full" and config.backend.sampler == "generate":
        fail("backend.sampler generate with finetune full: full-parameter training samples its live (sharded, "
             "gathered) weights with the in-process engine or a vLLM server", "Set backend.sampler: hf or vllm.")
    config = config.replace(reward_fn=reward)
    if config.mismatch.correction is None:  # the default: correct what a lag adds, only where there is one
        resolved = "truncate" if config.off_policy > 0 else "none"
        config = config.replace(mismatch=config.mismatch.model_copy(update={"correction": resolved}))
    dataset = config.dataset or task_class.default_dataset
    check_extra(config.extra, {**paradigm_class.declared_options, **task_class.declared_options},
                f"--env {config.env} with --mode {config.mode}", dataset=dataset, reward_fn=reward)
    config = config.with_values(settle(config))  # options read only in some settings: filled, or refused
    _VALIDATED[id(config)] = config
    return config


def _dotted(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def check_limits(config: Any) -> None:
    """``ConfigError`` naming the first value of ``config`` (a ``TrainConfig``) outside its :data:`LIMITS`."""
    for key, limit in LIMITS.items():
        value = _dotted(config, key)
        if value is None or limit.contains(value):
            continue
        side = "above" if value > limit.high else "below"
        bound = limit.high if value > limit.high else limit.low
        raise ConfigError(f"{named(key)} {shown(value)} is {side} its limit of {shown_number(bound)}: {limit.why}. "
                          f"Pass a value {limit.range()}.")
