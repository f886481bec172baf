"""Held-out evaluation: ``eval`` (one model or saved weights) and ``eval-checkpoints`` (every checkpoint of a run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlrunbook.cli.arguments import limited
from rlrunbook.cli.config_options import add_config_options, given_values

# The config fields eval takes, as train does: what to sample and how to score it.
EVAL_CONFIG_KEYS = ("model", "env", "dataset", "reward_fn", "seed", "temperature", "max_tokens", "min_p")


def cmd_eval(args: argparse.Namespace) -> int:
    from rlrunbook.backend import create_service_client
    from rlrunbook.rl.evaluation.evaluate import rewards_per_problem
    from rlrunbook.rl.evaluation.passk import pass_at_k, summarize_eval
    from rlrunbook.rl.rollout.paradigms import RolloutContext
    from rlrunbook.rl.setup.config_sources import build_config
    from rlrunbook.rl.setup.preflight import check_output_file, preflight
    from rlrunbook.rl.setup.prepare import prepare
    from rlrunbook.run.jsonio import atomic_write_json
    from rlrunbook.run.redaction import redact_config

    for k in args.ks:  # a k above --samples is refused before any model loads
        pass_at_k(args.samples, 0, k)
    if args.out:
        check_output_file(args.out)  # before the evaluation, whose results it would otherwise lose
    # Validated as train's flags are: a bad value (--temperature nan) is a ConfigError naming it, not a traceback.
    requested = build_config(cli=given_values(args)).config
    preflight(requested, writes_run_dir=False)  # the model before the data (see plan_run)
    config, _, task, problems = prepare(requested)
    print(f"[data] {task.announcement(problems)}", flush=True)
    for notice in task.notices:
        print(f"[data] notice: {notice}", flush=True)
    problems = problems[: args.num_problems]
    service = create_service_client()
    sampler = (service.create_sampling_client(model_path=args.weights) if args.weights
               else service.create_sampling_client(base_model=config.model))
    tokenizer = sampler.get_tokenizer()
    ctx = RolloutContext(sampler, tokenizer, task, config.rollout_settings(), [tokenizer.eos_token_id])
    print(f"[eval] {len(problems)} problems x {args.samples} samples of {args.weights or config.model}", flush=True)
    rewards = rewards_per_problem(ctx, problems, args.samples, seed=config.seed)
    summary = summarize_eval(rewards, ks=args.ks, threshold=args.threshold, confidence=args.confidence,
                             resamples=args.resamples, seed=config.seed)
    ci = f"{summary.confidence:.0%} bootstrap CI over problems"
    print(f"mean reward: {summary.mean_reward:.4f} [{summary.mean_ci[0]:.4f}, {summary.mean_ci[1]:.4f}] ({ci})")
    for k, value in summary.pass_at.items():
        low, high = summary.pass_ci[k]
        print(f"pass@{k}: {value:.4f} [{low:.4f}, {high:.4f}]  (reward >= {summary.threshold:g})")
    highest = max((r for row in rewards for r in row), default=None)
    if highest is not None and highest < args.threshold:
        print(f"warning: no sample reached --threshold {args.threshold:g} (the highest reward was {highest:g}), so "
              "every pass@k is 0 by the threshold; pass the reward a solved problem gets (1 for this project's "
              "tasks)", file=sys.stderr, flush=True)
    if args.out:
        document = {**summary.to_dict(), "config": redact_config(config.to_dict()), "weights": args.weights,
                    "problem_ids": [p.id for p in problems], "rewards": rewards}
        atomic_write_json(Path(args.out), document, indent=1)
        print(f"written: {args.out}")
    return 0


def cmd_eval_checkpoints(args: argparse.Namespace) -> int:
    from rlrunbook.rl.evaluation.checkpoint_eval import EvalOptions, evaluate_checkpoints, table_columns
    from rlrunbook.run.tools import format_table, write_table

    if args.out:
        from rlrunbook.rl.setup.preflight import check_output_file

        check_output_file(args.out)
    options = EvalOptions(samples=args.samples, num_problems=args.num_problems, ks=tuple(args.ks),
                          threshold=args.threshold, confidence=args.confidence, resamples=args.resamples,
                          include_base=not args.no_base, dataset=args.dataset)
    rows = evaluate_checkpoints(Path(args.run_dir), options, log=lambda line: print(line, flush=True))
    columns = table_columns(options.ks)
    print(f"held-out mean reward and pass@k (reward >= {options.threshold:g}), "
          f"{options.confidence:.0%} bootstrap CIs over problems:")
    print(format_table(rows, columns))
    if args.out:
        print(f"table: {write_table(rows, Path(args.out), columns)}")
    return 0


def add_commands(commands) -> None:
    bounded = limited()
    evaluate = commands.add_parser("eval", help="pass@k and mean reward with bootstrap CIs: N samples of each "
                                                "problem from the base model or saved weights")
    add_config_options(evaluate, EVAL_CONFIG_KEYS)
    evaluate.add_argument("--weights", help="saved sampler weights (tinker://...) instead of the base model")
    evaluate.add_argument("--num-problems", type=bounded["problems"], default=None, help="first P problems (all)")
    evaluate.add_argument("--samples", type=bounded["samples"], default=8, help="completions per problem (8)")
    evaluate.add_argument("--ks", type=bounded["samples"], nargs="+", default=[1, 4, 8], help="k values (1 4 8)")
    evaluate.add_argument("--threshold", type=float, default=1.0, help="a sample passes at reward >= this (1.0)")
    evaluate.add_argument("--confidence", type=float, default=0.95, help="bootstrap CI level (0.95)")
    evaluate.add_argument("--resamples", type=bounded["resamples"], default=2000, help="bootstrap resamples (2000)")
    evaluate.add_argument("--out", help="write the summary, config and every reward as JSON")
    evaluate.set_defaults(func=cmd_eval)

    checkpoints = commands.add_parser("eval-checkpoints", help="evaluate every checkpoint of a run (and the base "
                                                               "model as step 0) on held-out problems: one row per "
                                                               "step, mean reward and pass@k with bootstrap CIs")
    checkpoints.add_argument("run_dir", metavar="RUN_DIR")
    checkpoints.add_argument("--samples", type=bounded["samples"], default=8, help="completions per problem (8)")
    checkpoints.add_argument("--num-problems", type=bounded["problems"], default=16, help="held-out problems (16)")
    checkpoints.add_argument("--ks", type=bounded["samples"], nargs="+", default=[1, 4, 8], help="k values (1 4 8)")
    checkpoints.add_argument("--threshold", type=float, default=1.0, help="a sample passes at reward >= this (1.0)")
    checkpoints.add_argument("--confidence", type=float, default=0.95, help="bootstrap CI level (0.95)")
    checkpoints.add_argument("--resamples", type=bounded["resamples"], default=2000,
                             help="bootstrap resamples (2000)")
    checkpoints.add_argument("--no-base", action="store_true", help="leave out step 0 (the base model)")
    checkpoints.add_argument("--dataset", help="evaluate on this data set instead of the run's held-out problems "
                                               "(those its training never drew)")
    checkpoints.add_argument("--out", help="also write the table: .csv, .tsv or .md")
    checkpoints.set_defaults(func=cmd_eval_checkpoints)
