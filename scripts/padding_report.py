"""The attention padding of a preset's planned ``forward_backward`` micro-batches, by completion lengths.

Lengths only, no model: the preset's batch (``num_groups`` prompts x ``num_rollouts / num_groups`` samples) with
prompts and completions of the lengths below, split into micro-batches as its memory plan and
``backend.grad_accum_steps`` split it, each pass's attention rows batched for the preset's device
(:func:`rlrunbook.backend.padding.planned_padding`). Printed per length distribution, for the padding-capped
grouping the trainer runs and for rows batched by the element bound alone:

    python scripts/padding_report.py --config-file h100-rlvr --device-memory 80GiB

Padded query positions are over the distinct tokens a micro-batch computes; padded score elements over the
elements of every row's own rectangle (its queries x the keys it reads). The products and the output layer
compute no padding (flat tokens; see :mod:`rlrunbook.backend.padding`).
"""

from __future__ import annotations

import argparse
import math
import random

from rlrunbook.backend.padding import grouped_sequences, planned_padding
from rlrunbook.rl.setup.config_sources import build_config
from rlrunbook.rl.setup.memory_plan import parse_size, plan_memory


def length_cases(groups: int, samples: int, prompt: int, new: int, seed: int = 0) -> dict[str, tuple[list, list]]:
    """(prompt lengths, completion lengths per group) by name: every completion at full length; completions
    uniform in 1..new (seeded); prompts uniform in 64..prompt as well; completions of 129 + 128 k tokens (each
    path's last row holds 1 query); short completions, uniform in 1..256."""
    rng = random.Random(seed)

    def completions(draw) -> list[list[int]]:
        return [[draw() for _ in range(samples)] for _ in range(groups)]

    full = [prompt] * groups
    return {
        f"full length ({new})": (full, completions(lambda: new)),
        f"completions uniform 1..{new}": (full, completions(lambda: rng.randint(1, new))),
        f"prompts uniform 64..{prompt}, completions 1..{new}": (
            [rng.randint(64, prompt) for _ in range(groups)], completions(lambda: rng.randint(1, new))),
        "completions 129 + 128k tokens": (full, completions(lambda: 129 + 128 * rng.randint(0, (new - 129) // 128))),
        "completions uniform 1..256": (full, completions(lambda: rng.randint(1, min(256, new)))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-file", default="h100-rlvr")
    parser.add_argument("--device-memory", default=None, help="plan for this size (default: the device's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = build_config(file=args.config_file, overrides=[], cli={}, strict=False).config
    plan = plan_memory(config, parse_size(args.device_memory) if args.device_memory else None)
    groups, samples = config.num_groups, config.num_rollouts // config.num_groups
    chunks = config.backend.grad_accum_steps or 1
    device = plan.device.split(" ")[0]
    print(f"{args.config_file}: {groups} x {samples} rows, prompts {config.data.max_prompt_tokens}, "
          f"{config.max_tokens} new tokens; micro-batches of {plan.micro_batch_tokens} tokens, at least {chunks}; "
          f"attention batched for {device}")
    cases = length_cases(groups, samples, config.data.max_prompt_tokens, config.max_tokens, args.seed)
    for name, (prompts, completions) in cases.items():
        sequences = grouped_sequences(prompts, completions)
        for label, tolerance in (("capped", None), ("bound only", math.inf)):
            extra = {} if tolerance is None else {"tolerance": tolerance}
            got = planned_padding(sequences, plan.micro_batch_tokens, chunks, device, **extra)
            print(f"{name:48s} {label:10s} tokens {got.tokens:7d} in {got.micro_batches:2d} micro-batches, "
                  f"{got.attention_batches / got.micro_batches:5.1f} attention batches each; padded query "
                  f"positions {got.queries.fraction:6.2%}, padded score elements {got.scores.fraction:6.2%}")


if __name__ == "__main__":
    main()
