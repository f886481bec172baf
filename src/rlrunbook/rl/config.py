"""The training run's configuration, validated before any model loads.

Each rule names itself and its fix. The seeds' flags keep their names (``-n``, ``--num-groups``,
``--debate-train``, ...); the CLI maps them onto :class:`TrainConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from rlrunbook.errors import ConfigError
from rlrunbook.models.registry import DEFAULT_MODEL
from rlrunbook.rl.tasks import get_task_class

DebateTrain = Literal["rejection", "rs_grpo"]


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Attributes are the CLI's options; every one has a docstring-grade comment."""

    mode: str = "single_turn"          # interaction protocol: one answer per rollout, or a 3-round debate
    env: str = "qa"                     # task: qa (arithmetic/GSM8K/NQ-open), summary (CNN/DailyMail), math, or a plug-in
    dataset: str | None = None          # data set: "test" (built-in arithmetic), a hub name or a JSONL path
    num_rollouts: int = 16              # rollouts per step (-n); split evenly into question groups
    num_groups: int = 1                 # question groups per step; each group shares one question
    steps: int = 1                      # optimizer steps (-s)
    name: str = "run"                   # run name, last part of the run directory's name
    seed: int = 0                       # seeds data order, LoRA init and sampling
    temperature: float = 1.0            # sampling temperature of the policy
    max_tokens: int = 64                # tokens per completion (per debate turn)
    min_p: float = 0.0                  # min-p filter (local backend only)
    reward_fn: str | None = None        # qa: numeric|text; summary: compression|rouge; math: math
    mock_judge: bool = False            # debate: deterministic judge (higher task reward wins) instead of a model
    judge_model: str | None = None      # debate: model of the model judge (default: the base model)
    debate_train: DebateTrain = "rejection"  # debate: train on winners, or RS then GRPO on the task reward
    debate_grpo_reward: Literal["task"] | None = None  # rs_grpo's reward: the task reward of the winners
    model: str = DEFAULT_MODEL          # built-in name, local folder or hub id (smollm2-135m)
    log_root: str | None = None         # root of run directories (else RLRUNBOOK_LOG_ROOT, else ./logs)
    learning_rate: float = 1e-4         # AdamW learning rate
    lora_rank: int = 16                 # LoRA rank
    loss_fn: str = "importance_sampling"  # the Tinker loss trained with
    summary_max_words: int = 150        # summary: the article is cut to this many words for the prompt
    deterministic: bool = False         # seed Python/NumPy/torch and use deterministic torch algorithms
    expected_dataset_hash: str | None = None  # refuse the run if the data set's fingerprint differs
    extra: dict = field(default_factory=dict, compare=False)  # task plug-in options

    @property
    def group_size(self) -> int:
        return self.num_rollouts // self.num_groups

    @property
    def run_mode(self) -> str:
        """Name used in the run directory: grpo, rejection or rs_grpo."""
        return "grpo" if self.mode == "single_turn" else self.debate_train

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate(config: TrainConfig) -> TrainConfig:
    """Return ``config`` with defaults filled (reward_fn), or raise ``ConfigError`` naming rule and fix."""
    def fail(rule: str, fix: str) -> None:
        raise ConfigError(f"{rule}. {fix}")

    if config.num_rollouts < 1 or config.num_groups < 1 or config.steps < 1:
        fail(f"-n {config.num_rollouts}, --num-groups {config.num_groups}, -s {config.steps} must all be >= 1",
             "Pass positive counts.")
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
    elif config.debate_grpo_reward is not None or config.mock_judge:
        fail("--mock-judge and --debate-grpo-reward apply to --mode debate only", "Drop them or use --mode debate.")
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
    if not config.learning_rate > 0:
        fail(f"--learning-rate {config.learning_rate} must be > 0", "Use e.g. 1e-4.")
    if not config.name or any(c in config.name for c in "/\\") or config.name in (".", ".."):
        fail(f"--name {config.name!r} must be a plain name", "Use letters, digits, '-' and '_'.")
    return dataclasses.replace(config, reward_fn=reward)
