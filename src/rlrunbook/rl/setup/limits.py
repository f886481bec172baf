"""The limits of a run's numbers, in one place: what the code can hold and what a machine can run.

A value outside its limit is refused by :func:`rlrunbook.rl.setup.config_checks.validate` before any model
loads, with the limit and its reason. The limits are wide: each lies orders of magnitude beyond the runs
this project plans (hundreds of rollouts a step, hundreds of steps, completions of a few thousand tokens),
so they never bind a real run; they stop values that cannot be held (a seed beyond int64) or could never
finish (10^20 rollouts a step would sample until killed). Whether a valid size fits the device
is the memory plan's question (:mod:`rlrunbook.rl.setup.memory_plan`), not this module's.

The data layer keeps its own limits (line length, nesting, generated set sizes) in
:mod:`rlrunbook.rl.data.limits`; config files' YAML limits live here, beside the other config limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlrunbook.adam_params import MAX_LEARNING_RATE  # the backend refuses a step above it too
from rlrunbook.lora_rank import MAX_LORA_RANK  # so does the backend's LoRA wrapping

MAX_SEED = 2**63 - 1  # torch.manual_seed and the sampler's seed mixing (engines.noise) take int64 seeds
MAX_ROLLOUTS = 65_536  # rows sampled in one step: 100x the "hundreds of rows a step" this project is built for
MAX_STEPS = 1_000_000  # optimizer steps: years of the planned runs' step times
MAX_TOKENS = 1_048_576  # 2^20 tokens per completion or prompt: beyond any published model's context window
MAX_SUMMARY_WORDS = 100_000  # 50x CNN/DailyMail's longest article
MAX_HELD_OUT = 1_000_000  # validation problems: more than any of the data sets the tasks read
MAX_SAMPLING_ROUNDS = 64  # dynamic sampling rounds a step; a step still tied after 64 draws is better skipped
MAX_BATCH_TOKENS = MAX_ROLLOUTS * 2 * MAX_TOKENS  # a step's rows x (prompt + completion) at the limits above
MAX_RESAMPLES = 1_000_000  # bootstrap resamples of eval's confidence intervals (2,000 by default)
MAX_TEMPERATURE = 100.0  # logits / 100: every token of a model's vocabulary about equally likely
MAX_ENTROPY_COEF = 10.0  # a token's entropy is at most ln(vocabulary) (~11 nats); the policy term is ~1 a token
MAX_SWEEP_POINTS = 1_000  # runs one sweep makes: each point is a whole training run
MAX_OFF_POLICY = 64  # batches in flight: 8x prime-rl's default lag; each holds a copy of the adapter

# Config files (rl.setup.yaml_source): a config is a few kilobytes of at most three levels.
MAX_CONFIG_BYTES = 1_048_576
MAX_YAML_DEPTH = 32  # nested collections
MAX_YAML_ALIASES = 100  # *alias references; anchors that share a section use a handful
MAX_YAML_NODES = 100_000  # values after every alias is expanded ("billion laughs" expands to 10^9)
MAX_YAML_INT_DIGITS = 30  # no setting needs more than 19 digits (2^63)


@dataclass(frozen=True)
class Limit:
    """The inclusive range of one config value (``low_open``: ``low`` itself excluded) and why the range is what
    it is."""

    low: int | float
    high: int | float
    why: str
    low_open: bool = False

    def contains(self, value: int | float) -> bool:
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def range(self) -> str:
        """``from 1 to 65,536``, ``above 0 and at most 1``."""
        if self.low_open:
            return f"above {shown_number(self.low)} and at most {shown_number(self.high)}"
        return f"from {shown_number(self.low)} to {shown_number(self.high)}"


LIMITS: Mapping[str, Limit] = {
    "seed": Limit(0, MAX_SEED, "seeds are torch's int64 seeds (torch.manual_seed, the sampler's seed "
                  "mixing), and a negative one would be read modulo 2^64"),
    "num_rollouts": Limit(1, MAX_ROLLOUTS, "rollouts are rows sampled in one step; this project plans "
                          "hundreds a step, and the memory plan refuses far fewer on one device"),
    "num_groups": Limit(1, MAX_ROLLOUTS, "each group holds at least one rollout"),
    "steps": Limit(1, MAX_STEPS, "a million optimizer steps outlasts any run this project plans"),
    "off_policy": Limit(0, MAX_OFF_POLICY, "each batch in flight holds a snapshot of the "
                        "adapter, and a lag of 64 steps is 8x the widest that asynchronous RL stacks default to "
                        "(prime-rl, 8)"),
    "max_tokens": Limit(1, MAX_TOKENS, "2^20 tokens is beyond any published model's context "
                        "window, and the sampler's cache is sized rows x tokens"),
    "lora_rank": Limit(1, MAX_LORA_RANK, "a rank above a layer's width adds no capacity, and "
                       "16,384 is the widest layer of a published dense model"),
    "learning_rate": Limit(0, MAX_LEARNING_RATE, "Adam moves every weight by about the "
                           "learning rate each step whatever the gradient's scale, so above 1 each adapter weight "
                           "moves by more than its own size and the run diverges; LoRA runs use 1e-6 to 1e-3",
                           low_open=True),
    "summary_max_words": Limit(1, MAX_SUMMARY_WORDS, "the words of the article kept in "
                               "the prompt: 0 asks to summarise nothing, and 100,000 is 50x the longest "
                               "CNN/DailyMail article"),
    "temperature": Limit(0, MAX_TEMPERATURE, "the logits are divided by it, and at 100 every "
                         "token of the vocabulary is about equally likely: sampling stops depending on the policy; "
                         "RL runs use 0.6 to 1.2"),
    "loss.entropy_coef": Limit(0, MAX_ENTROPY_COEF, "a token's entropy is at most "
                               "ln(vocabulary size), about 11 nats, while the policy term is about one advantage a "
                               "token, so above 10 the bonus is the whole objective; runs use 0.001 to 0.01"),
    "checkpoint.every": Limit(0, MAX_STEPS, "a step count (0 = off)"),
    "validation.every": Limit(0, MAX_STEPS, "a step count (0 = off)"),
    "validation.samples": Limit(1, MAX_ROLLOUTS, "samples per problem are rows sampled at "
                                "once, bounded like -n"),
    "validation.num_problems": Limit(1, MAX_HELD_OUT, "held-out problems come out of "
                                     "the data set, and no data set here has a million rows"),
    "data.max_prompt_tokens": Limit(1, MAX_TOKENS, "bounded like --max-tokens"),
    "dynamic_sampling.max_rounds": Limit(1, MAX_SAMPLING_ROUNDS, "each round "
                                         "samples the step's missing groups again; a step still tied after 64 "
                                         "rounds is better skipped"),
    "dynamic_sampling.max_skipped_steps": Limit(1, MAX_STEPS, "a step count"),
    "backend.grad_accum_steps": Limit(1, MAX_ROLLOUTS, "chunks of a step's rows: "
                                      "more chunks than rows are empty"),
    "backend.micro_batch_tokens": Limit(0, MAX_BATCH_TOKENS, "a step's rows x "
                                        "(prompt + completion) tokens at the limits of -n and --max-tokens"),
}


def shown(value: Any, width: int = 60) -> str:
    """``value`` quoted for a message: a huge integer by its size (``str`` of one beyond 4,300 digits raises),
    anything else by its ``repr``, cut to ``width`` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        digits = int(abs(value).bit_length() * 0.30103) + 1
        return f"{'-' if value < 0 else ''}a number of about {digits:,} digits"
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def shown_number(value: int | float) -> str:
    """``1,024`` for an integer, ``0.001`` for a float, ``2^63 - 1`` for the largest seed."""
    if value == MAX_SEED:
        return "2^63 - 1"
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"
