"""``rlrunbook train`` and ``rlrunbook show-config``: a run config from file, overrides and flags (sweeps
make one per point), trained and checked, or printed with where each value came from."""

from __future__ import annotations

import argparse
import os
import sys

from rlrunbook.allocator import keep_freed_memory
from rlrunbook.cli.arguments import bounded_int, service_url
from rlrunbook.cli.config_options import add_config_options, given_values
from rlrunbook.errors import ConfigError

WORLD_SIZE = bounded_int(1, 1 << 16, "the processes of one torchrun launch")


def resolve_runs(args: argparse.Namespace):
    """One resolved config per sweep point (one when there is no sweep), all validated up front."""
    from rlrunbook.rl.setup.config_checks import validate
    from rlrunbook.rl.setup.config_sources import build_config, check_distinct_points, sweep_grid, sweep_name

    layers = dict(file=args.config_file, overrides=args.overrides, cli=given_values(args),
                  strict=args.strict_config)
    base = build_config(**layers)
    points = sweep_grid(args.config_file, args.sweep)
    runs = []
    for values in points:
        named = {**values, "name": sweep_name(base.config.name, values)} if values else {}
        resolved = build_config(**layers, sweep_values=named)
        validate(resolved.config)  # every point is checked before the first run starts
        runs.append(resolved)
    check_distinct_points(runs, points)
    return runs


def cmd_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rlrunbook import distributed
    from rlrunbook.rl.training.loop import run_training
    from rlrunbook.run import check_run, format_results, rubric_passed

    if getattr(args, "service", None):  # the backend is chosen by the environment: this process's, for this run
        os.environ["TINKER_BACKEND"] = "api"
        os.environ["TINKER_BASE_URL"] = args.service
    runs = resolve_runs(args)
    keep_freed_memory()  # the steps' large buffers reused, not faulted in anew (rlrunbook/allocator.py)
    if getattr(args, "resume_from", None) is None:
        from rlrunbook.rl.setup.preflight import check_run_location

        for resolved in runs:  # every sweep point's run directory, before the first run starts
            check_run_location(resolved.config)
    argv = sys.argv[1:] if args.argv is None else args.argv
    resume_from = getattr(args, "resume_from", None)
    if resume_from is not None and len(runs) > 1:
        raise ConfigError("--resume-from continues one run; it cannot be combined with a sweep. "
                          "Drop --sweep (and the config file's sweep:) or resume each run on its own.")

    def progress(steps):
        return tqdm(steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    failed = 0
    run_dirs = []
    for index, resolved in enumerate(runs):
        if len(runs) > 1:
            print(f"[sweep] run {index + 1}/{len(runs)}: {resolved.config.name}", flush=True)
        run_dir = run_training(resolved.config, argv=argv, config_sources=resolved.sources, progress=progress,
                               log=lambda line: tqdm.write(line, file=sys.stdout), resume_from=resume_from)
        if not distributed.is_main():
            continue  # under torchrun rank 0 checks and reports the run it wrote
        results = check_run(run_dir)
        print(format_results(results))
        print(f"run directory: {run_dir}")
        failed += not rubric_passed(results)
        run_dirs.append(run_dir)
    if len(runs) > 1 and run_dirs:
        from rlrunbook.run.tools import format_table, summarize_runs

        print(format_table(summarize_runs(run_dirs)))
    return 1 if failed else 0


def check_logprobs_arguments(config) -> list[str]:
    """The ``check-logprobs`` arguments that check what a train run of ``config`` samples and trains: its model,
    LoRA rank (a LoRA run's), temperature and min-p, and the backend's device, dtype and sampler where the run
    states them (otherwise both commands take them from the same ``TINKER_LOCAL_*`` environment)."""
    from rlrunbook.rl.setup.config_checks import validate

    config = validate(config)  # lora_rank: null until it applies
    arguments = ["--model", config.model, *(["--lora-rank", str(config.lora_rank)] if config.lora_rank else []),
                 "--temperature", repr(config.temperature), "--min-p", repr(config.min_p)]
    for name in ("device", "dtype", "sampler"):
        value = getattr(config.backend, name)
        if value is not None:
            arguments += [f"--{name}", str(value)]
    return arguments


def world_size(args: argparse.Namespace, env=os.environ) -> int:
    """The ranks a plan is made for: ``--world-size``, else the ``WORLD_SIZE`` torchrun sets, else 1."""
    if args.world_size is not None:
        return args.world_size
    text = env.get("WORLD_SIZE", "").strip()
    try:
        return WORLD_SIZE(text) if text else 1
    except argparse.ArgumentTypeError as error:
        raise ConfigError(f"WORLD_SIZE={text[:40]!r} is not a world size: {error}. Unset it, or pass "
                          "--world-size N.") from None


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    from rlrunbook.rl.setup.placement import placement
    from rlrunbook.run.redaction import redact_config

    runs = resolve_runs(args)
    if args.memory_plan or args.device_memory or args.world_size is not None:
        from rlrunbook.rl.setup.memory_plan import check_fits, format_plan, parse_size, plan_memory

        size = parse_size(args.device_memory) if args.device_memory else None
        ranks = world_size(args)
        plans = [plan_memory(resolved.config, size, world_size=ranks) for resolved in runs]
        for resolved, plan in zip(runs, plans, strict=True):
            print(f"# memory plan of {resolved.config.name}:")
            print("\n".join(f"#   {line}" for line in format_plan(plan)))
        refused = 0
        for plan in plans:  # what train would refuse, with the knob that fixes it
            try:
                check_fits(plan)
            except ConfigError as error:
                print(f"error: {error}", file=sys.stderr)
                refused += 1
        return 1 if refused else 0
    if args.check_logprobs_args:
        if len(runs) != 1:
            raise ConfigError(f"--check-logprobs-args needs one run, but the sweep makes {len(runs)}: drop --sweep.")
        print("\n".join(check_logprobs_arguments(runs[0].config)))
        return 0
    for resolved in runs:
        print(f"# config{f' from {resolved.file}' if resolved.file else ''}; value sources:")
        for key, origin in resolved.sources.items():
            if origin != "default":
                print(f"#   {key}: {origin}")
        print("# what runs where:")
        for line in placement(resolved.config.backend, os.environ):
            print(f"#   {line}")
        print(yaml.safe_dump(redact_config(resolved.config.to_dict()), sort_keys=False), end="")
        print("---")
    return 0


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """train's options: a config file, dotted overrides, sweeps and one flag per common config key."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. steps=4 loss.kl_coef=0.05 (beat the file, lose to flags)")
    parser.add_argument("--config-file", help="YAML config: a path or a preset name under configs/ "
                                              "(tiny-cpu-smoke, smollm2-cpu-mini, ...)")
    parser.add_argument("--strict-config", action="store_true",
                        help="refuse the run if any field falls back to a default the file does not state")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="one run per combination of the listed values (repeatable)")
    parser.add_argument("--no-proxy", action="store_true", help="accepted for older run scripts that pass it; no effect")
    add_config_options(parser)


def add_commands(commands) -> None:
    train = commands.add_parser("train", help="train a LoRA policy: single-turn GRPO or debate with rejection "
                                              "sampling / RS-GRPO; writes a run directory and checks it")
    _add_train_arguments(train)
    train.add_argument("--resume-from", metavar="RUN_DIR|CHECKPOINT",
                       help="continue a run from its last checkpoint (or the given one) in a new run directory")
    train.add_argument("--service", metavar="URL", type=service_url,
                       help="train through a running Tinker service (rlrunbook serve, or any): the same as "
                            "TINKER_BACKEND=api TINKER_BASE_URL=URL; its key from TINKER_API_KEY")
    train.set_defaults(func=cmd_train, argv=None)

    show = commands.add_parser("show-config", help="print the resolved config of a train command (file, overrides, "
                                                   "flags, sweep points) and where each value came from")
    _add_train_arguments(show)
    show.add_argument("--memory-plan", action="store_true",
                      help="print the predicted memory of sampling and training on the run's device instead of the "
                           "config (exit 1 when it does not fit); no model loads")
    show.add_argument("--device-memory", metavar="SIZE",
                      help="plan for a device of this size (e.g. 80GiB for an H100 80GB) instead of this machine's; "
                           "implies --memory-plan")
    show.add_argument("--world-size", type=WORLD_SIZE, metavar="N",
                      help="plan one of N ranks of a torchrun launch (default: WORLD_SIZE, else 1): a full fine-tune's "
                           "state is sharded over them and each samples and trains 1/N of the groups; implies "
                           "--memory-plan")
    show.add_argument("--check-logprobs-args", action="store_true",
                      help="print, one per line, the check-logprobs arguments that check what this train command "
                           "runs (model, LoRA rank, temperature, min-p; backend device, dtype, sampler); "
                           "scripts/run.sh uses it")
    show.set_defaults(func=cmd_show_config)
