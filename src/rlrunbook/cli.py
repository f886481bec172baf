"""The ``rlrunbook`` command.

    rlrunbook check-logprobs --model tiny --prompt "What is 7 * 8?" --max-tokens 32
    rlrunbook train --mode debate --env summary --reward-fn compression -n 16 --num-groups 2 -s 2 \
        --mock-judge --debate-train rs_grpo --debate-grpo-reward task --name mini
    rlrunbook check-run logs/<run>
    rlrunbook train ... --checkpoint-every 2; rlrunbook train --resume-from logs/<run> -s 8
    rlrunbook eval-checkpoints logs/<run> --samples 8 --ks 1 4 8 --out table.csv
    rlrunbook resolve-model smollm2-135m
    rlrunbook bench-history --png trend.png
    rlrunbook serve --port 8000 --api-key tml-...
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rlrunbook import cli_errors, cli_signals, pending_signal
from rlrunbook.errors import ConfigError

_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# train's flags (argparse dest) → the config key they set.
TRAIN_FLAGS = {name: name for name in (
    "mode", "env", "dataset", "num_rollouts", "num_groups", "steps", "off_policy", "name", "seed", "temperature", "max_tokens",
    "min_p", "reward_fn", "mock_judge", "judge_model", "debate_train", "debate_grpo_reward", "model", "log_root",
    "learning_rate", "lora_rank", "loss_fn", "summary_max_words", "deterministic", "expected_dataset_hash")}
TRAIN_FLAGS.update({
    "kl_coef": "loss.kl_coef", "kl_estimator": "loss.kl_estimator", "entropy_coef": "loss.entropy_coef",
    "grad_clip_norm": "loss.grad_clip_norm", "checkpoint_every": "checkpoint.every",
    "val_every": "validation.every", "val_samples": "validation.samples", "cache_dataset": "data.cache",
    "max_prompt_tokens": "data.max_prompt_tokens", "truncate_prompts": "data.truncate_prompts",
    "blocklist": "reward.blocklist", "reject_blocklisted": "reward.reject_blocklisted",
})


def _encode_prompt(tokenizer, text: str, raw: bool) -> list[int]:
    """Token ids of ``text`` as a user turn (chat template), or as plain text with ``raw``."""
    if not raw and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _check_settings(args: argparse.Namespace):
    """The local backend settings ``train`` would use (``TINKER_LOCAL_*``), with this command's flags on top."""
    import torch

    from rlrunbook.backend.settings import LocalSettings

    settings = LocalSettings.from_env()
    changes: dict[str, object] = {}
    if args.device:
        changes["device"] = args.device
    if args.dtype:
        changes["dtype"] = getattr(torch, args.dtype)
    if args.sampler:
        changes["sampler"] = args.sampler
    if args.numerics:
        changes["numerics"] = args.numerics
    return dataclasses.replace(settings, **changes)


def cmd_check_logprobs(args: argparse.Namespace) -> int:
    from rlrunbook.backend import LocalServiceClient
    from rlrunbook.diagnostics import parity_gates, sampler_trainer_parity
    from rlrunbook.engines.filters import SamplingFilters

    # Validate every option before the (slow) model load.
    filters = SamplingFilters(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    for name in ("max_tokens", "num_samples"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1.")
    settings = _check_settings(args)
    dtype = settings.resolved_dtype()
    dtype_name = str(dtype).removeprefix("torch.")
    gates = parity_gates(dtype, filters.temperature)
    if args.tolerance is not None:
        gates = dataclasses.replace(gates, max_abs=args.tolerance)
    print(f"[check-logprobs] loading {args.model}: engine {settings.sampler}, numerics {settings.numerics}, "
          f"{dtype_name} on {settings.device} (the settings train uses: TINKER_LOCAL_*, then these flags)", flush=True)
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client(args.model, rank=args.lora_rank, seed=args.seed)
        sampler = training.save_weights_and_get_sampling_client()
        prompt = _encode_prompt(training.get_tokenizer(), args.prompt, args.raw)
        report = sampler_trainer_parity(training, sampler, prompt, args.num_samples, args.max_tokens, filters,
                                        args.seed, gates)
        first = training.get_tokenizer().decode(report.completions[0]) if report.completions else None
        engine = sampler.engine_name
    print(f"engine: {engine}")
    print(f"numerics: {settings.numerics}  dtype: {dtype_name}  device: {settings.device}")
    print(f"prompt tokens: {len(prompt)}  sampled tokens: {report.num_tokens} "
          f"in {len(report.completions)} completion(s)")
    if first is not None:
        print(f"first completion: {first!r}")
    print(f"max_abs_diff: {report.max_abs_diff:.3e}")
    print(f"mean_abs_diff: {report.mean_abs_diff:.3e}")
    print(f"tolerance: max {gates.max_abs:.1e}, mean {gates.mean_abs:.1e} (|sampler - trainer| logprob under the "
          f"sampled distribution, {dtype_name}, T={filters.temperature})")
    print(f"boundary_flips: {report.boundary_flips} (sampled tokens the recomputed filters drop; "
          f"allowed {gates.max_flip_fraction:.0%} of tokens)")
    if report.ok:
        print("ok")
        return 0
    print("FAIL: Logprob mismatch: the sampler and the trainer disagree on the same tokens; "
          "do not train until this is fixed.", file=sys.stderr)
    return 1


def _train_cli_values(args: argparse.Namespace) -> dict[str, object]:
    """The config keys given as explicit flags (dotted names), for the ``cli`` layer."""
    return {key: getattr(args, dest) for dest, key in TRAIN_FLAGS.items() if getattr(args, dest, None) is not None}


def _resolve_runs(args: argparse.Namespace):
    """One resolved config per sweep point (one when there is no sweep), all validated up front."""
    from rlrunbook.rl.setup.config import validate
    from rlrunbook.rl.setup.config_sources import build_config, check_distinct_points, sweep_grid, sweep_name

    layers = dict(file=args.config_file, overrides=args.overrides, cli=_train_cli_values(args),
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


def _service_url(value: str) -> str:
    """An argparse type: an http(s) URL with a host, as ``TINKER_BASE_URL`` takes it."""
    from urllib.parse import urlparse

    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a service URL: give http://HOST:PORT (the TINKER_BASE_URL "
                                         "that rlrunbook serve prints)")
    return value.rstrip("/")


def cmd_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rlrunbook import distributed
    from rlrunbook.rl.training.loop import run_training
    from rlrunbook.run import check_run, format_results, rubric_passed

    if getattr(args, "service", None):  # the backend is chosen by the environment: this process's, for this run
        os.environ["TINKER_BACKEND"] = "api"
        os.environ["TINKER_BASE_URL"] = args.service
    runs = _resolve_runs(args)
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
    LoRA rank, temperature and min-p, and the backend's device, dtype and sampler where the run states them
    (otherwise both commands take them from the same ``TINKER_LOCAL_*`` environment)."""
    arguments = ["--model", config.model, "--lora-rank", str(config.lora_rank),
                 "--temperature", repr(config.temperature), "--min-p", repr(config.min_p)]
    for name in ("device", "dtype", "sampler"):
        value = getattr(config.backend, name)
        if value is not None:
            arguments += [f"--{name}", str(value)]
    return arguments


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    from rlrunbook.rl.setup.placement import placement
    from rlrunbook.run.redaction import redact_config

    runs = _resolve_runs(args)
    if args.memory_plan or args.device_memory:
        from rlrunbook.rl.setup.memory_plan import format_plan, parse_size, plan_memory

        size = parse_size(args.device_memory) if args.device_memory else None
        plans = [plan_memory(resolved.config, size) for resolved in runs]
        for resolved, plan in zip(runs, plans, strict=True):
            print(f"# memory plan of {resolved.config.name}:")
            print("\n".join(f"#   {line}" for line in format_plan(plan)))
        return 0 if all(plan.fits for plan in plans) else 1
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


def _existing_run_dir(path: str) -> Path:
    """``path`` if it is a directory; ``ConfigError`` naming what it is otherwise (check-run, not 13 FAILs)."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise ConfigError(f"run directory {path!r} does not exist. Pass the folder a run wrote, "
                          "logs/<timestamp>_<mode>_<env>_<name> (train prints it as 'run directory: ...').")
    if not run_dir.is_dir():
        raise ConfigError(f"{path!r} is a file, not a run directory. Pass the folder that holds its "
                          "run_metadata.json.")
    return run_dir


def cmd_check_run(args: argparse.Namespace) -> int:
    from rlrunbook.run import check_run, format_results, rubric_passed

    results = check_run(_existing_run_dir(args.run_dir))
    print(format_results(results))
    return 0 if rubric_passed(results) else 1


def cmd_resolve_model(args: argparse.Namespace) -> int:
    from rlrunbook.models import resolve_model

    print(resolve_model(args.name))
    return 0


def cmd_summarize(args: argparse.Namespace) -> int:
    from rlrunbook.run.tools import TERMINAL_LEGEND, format_table, summarize_runs, write_table

    if args.out:
        from rlrunbook.rl.setup.preflight import check_output_file

        check_output_file(args.out)
    rows = summarize_runs([Path(d) for d in args.run_dirs])
    print(format_table(rows))
    print(TERMINAL_LEGEND)
    if args.out:
        print(f"table: {write_table(rows, Path(args.out))}")
    return 1 if any(row["status"] == "unreadable" for row in rows) else 0


def cmd_package(args: argparse.Namespace) -> int:
    from rlrunbook.run.tools import find_secrets, package_run, verify_package

    from rlrunbook.run.paths import check_run_directory

    run_dir = _existing_run_dir(args.run_dir)
    check_run_directory(run_dir)  # any other folder is not archived as a run
    if args.out:
        from rlrunbook.run.outputs import check_not_a_run_file

        check_not_a_run_file(args.out)
    findings = [] if args.allow_secrets else find_secrets(run_dir, os.environ)
    if findings:
        print("refusing to package: possible secrets (file:line: kind; values not shown):", *findings,
              sep="\n  ", file=sys.stderr)
        print("remove those files or values, or pass --allow-secrets if they are not secrets", file=sys.stderr)
        return 1
    archive = package_run(run_dir, Path(args.out) if args.out else None, overwrite=args.overwrite)
    problems = verify_package(archive)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    print(f"archive: {archive} ({'verified' if not problems else 'NOT verified'})")
    return 1 if problems else 0


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
    fields = ("env", "dataset", "model", "seed", "temperature", "max_tokens", "min_p", "reward_fn")
    # Validated as train's flags are: a bad value (--temperature nan) is a ConfigError naming it, not a traceback.
    given = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    requested = build_config(cli=given).config
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


def cmd_cookbook(args: argparse.Namespace) -> int:
    from rlrunbook.cookbook.__main__ import run

    return run(args)


def cmd_bench_history(args: argparse.Namespace) -> int:
    from rlrunbook.bench_history import compare, format_comparison, load_runs, plot_trend

    if args.png:
        from rlrunbook.rl.setup.preflight import check_output_file

        check_output_file(args.png, "--png")
    runs = load_runs(Path(args.storage), args.machine)
    rows = compare(runs, args.threshold)
    print(format_comparison(runs, rows))
    if args.png:
        print(f"trend: {plot_trend(runs, Path(args.png))}")
    return 1 if any(row.regression for row in rows) else 0


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"rlrunbook serve needs {' and '.join(missing)}, which this environment lacks; install "
                          "them with pip install -e '.[serve]' (scripts/setup.sh does by default).")
    from rlrunbook.service import ServeOptions, serve
    from rlrunbook.service.server import API_KEY_ENV, keys_from

    options = ServeOptions(host=args.host, port=args.port, storage=Path(args.storage) if args.storage else None,
                           api_keys=keys_from(args.api_key, os.environ.get(API_KEY_ENV)), device=args.device,
                           max_body_bytes=args.max_body_mib * 2**20, session_timeout_s=args.session_timeout)
    return serve(options)


def add_serve_command(commands) -> None:
    """``rlrunbook serve``: the local backend as a Tinker service over HTTP (docs/serve.md)."""
    serve = commands.add_parser("serve", help="serve the local backend over the Tinker SDK's HTTP protocol: "
                                              "set TINKER_BASE_URL to the URL it prints (docs/serve.md)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (127.0.0.1); any non-loopback address needs --api-key")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (8000); 0 picks a free one, printed")
    serve.add_argument("--storage", metavar="DIR",
                       help="where tinker:// checkpoints live (default: TINKER_LOCAL_STORAGE, else "
                            "~/.cache/rlrunbook/tinker)")
    serve.add_argument("--api-key", metavar="KEY", action="append",
                       help="a key clients send as TINKER_API_KEY (starts with tml-); repeat it for several "
                            "tenants, each seeing only its own sessions; default: RLRUNBOOK_SERVE_API_KEY "
                            "(comma-separated); none = no key, loopback only")
    serve.add_argument("--device", default=None, help="default: TINKER_LOCAL_DEVICE, else cuda if available, else cpu")
    serve.add_argument("--max-body-mib", type=int, default=64,
                       help="largest request body in MiB (64); larger ones are refused with 413")
    serve.add_argument("--session-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="a session whose client sent no heartbeat for this long expires and its models' "
                            "memory is freed (300; the SDK sends one every 10 s); saved checkpoints stay")
    serve.set_defaults(func=cmd_serve)


def _count(low: int, high: int, why: str):
    """An argparse type: an integer from ``low`` to ``high`` (a limit of ``rlrunbook.rl.setup.limits``, whose
    reason ``why`` the refusal states), so 10^20 samples are refused at once instead of sampled until killed."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text if len(text) <= 40 else text[:37] + '...'} is outside "
                                             f"{low:,}..{high:,} ({why})")
        return value
    return parse


def _limited():
    """The bounded integer types of eval, eval-checkpoints and check-logprobs (imported late: the CLI loads fast)."""
    from rlrunbook.rl.setup import limits

    rows = _count(1, limits.MAX_ROLLOUTS, "rows sampled at once, bounded like train's -n")
    return {"samples": rows, "problems": _count(1, limits.MAX_HELD_OUT, "problems of a data set"),
            "resamples": _count(1, limits.MAX_RESAMPLES, "bootstrap resamples; 2,000 give stable 95% intervals"),
            "seed": _count(0, limits.MAX_SEED, "torch's int64 seeds"),
            "tokens": _count(1, limits.MAX_TOKENS, "beyond any model's context window"),
            "rank": _count(1, limits.MAX_LORA_RANK, "wider than any model's layers")}


def _positive_float(text: str) -> float:
    """A finite number > 0 (a tolerance of 0 or less passes nothing; inf or nan checks nothing)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0, e.g. 1e-4")
    return value


def add_run_tool_commands(commands) -> None:
    limited = _limited()
    summarize = commands.add_parser("summarize", help="one table row per run directory: status, rewards, loss, "
                                                      "tokens, timings; exit 1 if any run is unreadable")
    summarize.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    summarize.add_argument("--out", help="also write the table: .csv, .tsv or .md")
    summarize.set_defaults(func=cmd_summarize)

    package = commands.add_parser("package", help="archive a run directory as .tar.gz with a MANIFEST.sha256, "
                                                  "after a secret scan; verify the archive")
    package.add_argument("run_dir", metavar="RUN_DIR")
    package.add_argument("--archive", action="store_true", help="accepted for clarity: an archive is always made")
    package.add_argument("--out", help="archive path (default: RUN_DIR.tar.gz next to the run directory)")
    package.add_argument("--overwrite", action="store_true", help="replace an existing archive")
    package.add_argument("--allow-secrets", action="store_true",
                         help="package even if the scan finds secret values or credentials files")
    package.set_defaults(func=cmd_package)

    evaluate = commands.add_parser("eval", help="pass@k and mean reward with bootstrap CIs: N samples of each "
                                                "problem from the base model or saved weights")
    evaluate.add_argument("--model", help="base model: built-in name, local folder or hub id (smollm2-135m)")
    evaluate.add_argument("--weights", help="saved sampler weights (tinker://...) instead of the base model")
    evaluate.add_argument("--env", help="qa (default) | summary | math, or a registered task")
    evaluate.add_argument("--dataset", help="as for train; use problems the policy was not trained on")
    evaluate.add_argument("--reward-fn", help="as for train")
    evaluate.add_argument("--num-problems", type=limited["problems"], default=None, help="first P problems (all)")
    evaluate.add_argument("--samples", type=limited["samples"], default=8, help="completions per problem (8)")
    evaluate.add_argument("--ks", type=limited["samples"], nargs="+", default=[1, 4, 8], help="k values (1 4 8)")
    evaluate.add_argument("--threshold", type=float, default=1.0, help="a sample passes at reward >= this (1.0)")
    evaluate.add_argument("--confidence", type=float, default=0.95, help="bootstrap CI level (0.95)")
    evaluate.add_argument("--resamples", type=limited["resamples"], default=2000, help="bootstrap resamples (2000)")
    evaluate.add_argument("--seed", type=int, help="data set and sampling seed (0)")
    evaluate.add_argument("--temperature", type=float, help="sampling temperature (1.0)")
    evaluate.add_argument("--max-tokens", type=int, help="tokens per completion (64)")
    evaluate.add_argument("--min-p", type=float, help="min-p filter, local backend only (0 = off)")
    evaluate.add_argument("--out", help="write the summary, config and every reward as JSON")
    evaluate.set_defaults(func=cmd_eval)

    checkpoints = commands.add_parser("eval-checkpoints", help="evaluate every checkpoint of a run (and the base "
                                                               "model as step 0) on held-out problems: one row per "
                                                               "step, mean reward and pass@k with bootstrap CIs")
    checkpoints.add_argument("run_dir", metavar="RUN_DIR")
    checkpoints.add_argument("--samples", type=limited["samples"], default=8, help="completions per problem (8)")
    checkpoints.add_argument("--num-problems", type=limited["problems"], default=16, help="held-out problems (16)")
    checkpoints.add_argument("--ks", type=limited["samples"], nargs="+", default=[1, 4, 8], help="k values (1 4 8)")
    checkpoints.add_argument("--threshold", type=float, default=1.0, help="a sample passes at reward >= this (1.0)")
    checkpoints.add_argument("--confidence", type=float, default=0.95, help="bootstrap CI level (0.95)")
    checkpoints.add_argument("--resamples", type=limited["resamples"], default=2000,
                             help="bootstrap resamples (2000)")
    checkpoints.add_argument("--no-base", action="store_true", help="leave out step 0 (the base model)")
    checkpoints.add_argument("--dataset", help="evaluate on this data set instead of the run's held-out problems "
                                               "(those its training never drew)")
    checkpoints.add_argument("--out", help="also write the table: .csv, .tsv or .md")
    checkpoints.set_defaults(func=cmd_eval_checkpoints)

    from rlrunbook.cookbook.__main__ import DESCRIPTION, add_arguments

    cookbook = commands.add_parser("cookbook", description=DESCRIPTION,
                                   help="run a tinker-cookbook recipe unmodified on the local backend: "
                                        "rlrunbook cookbook [--renderer R] [--hf-dataset NAME=FILE] "
                                        "<recipe module> [recipe args]")
    # The runner's own options, then the recipe and its arguments (one positional taking the rest alone would
    # refuse a leading option: argparse.REMAINDER does not start at one).
    add_arguments(cookbook)
    cookbook.set_defaults(func=cmd_cookbook)

    history = commands.add_parser("bench-history", help="compare the last saved benchmark run "
                                  "(pytest-benchmark --benchmark-autosave) with the earlier ones; "
                                  "exit 1 on a regression; --png draws the trend")
    history.add_argument("--storage", default=".benchmarks", help="pytest-benchmark's storage (.benchmarks)")
    history.add_argument("--machine", help="machine folder in the storage (default: the newest run's)")
    history.add_argument("--png", help="also draw the trend into this PNG")
    history.add_argument("--threshold", type=_positive_float, default=0.15,
                         help="more than this fraction above the earlier runs' median is a regression (0.15)")
    history.set_defaults(func=cmd_bench_history)


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
    parser.add_argument("--mode", choices=None, help="single_turn (default) | debate, or a registered paradigm")
    parser.add_argument("--env", help="qa (default) | summary | math, or a registered task")
    parser.add_argument("--dataset", help="qa: test (built-in arithmetic, default) | gsm8k | nq_open; "
                                         "summary: cnn_dailymail; math: gsm8k; or a hub name or a JSONL path")
    parser.add_argument("-n", "--num-rollouts", dest="num_rollouts", type=int, help="rollouts per step (16)")
    parser.add_argument("--num-groups", type=int, help="question groups per step; must divide -n (1)")
    parser.add_argument("-s", "--steps", type=int, help="optimizer steps (1)")
    parser.add_argument("--off-policy", type=int, metavar="K",
                        help="asynchronous RL: sample up to K batches ahead of training, batch i from the weights "
                             "after step max(0, i - K) (0 = synchronous, the default)")
    parser.add_argument("--name", help="run name (run)")
    parser.add_argument("--seed", type=int, help="data order, LoRA init and sampling seed (0)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (1.0)")
    parser.add_argument("--max-tokens", type=int, help="tokens per completion / debate turn (64)")
    parser.add_argument("--min-p", type=float, help="min-p filter, local backend only (0 = off)")
    parser.add_argument("--reward-fn", help="qa: numeric | text | multi_signal; summary: compression | rouge; "
                                           "math: math | multi_signal")
    parser.add_argument("--mock-judge", action="store_const", const=True, help="debate: deterministic judge")
    parser.add_argument("--judge-model", help="debate: the model judge's model (default: the base model)")
    parser.add_argument("--debate-train", choices=["rejection", "rs_grpo"], help="debate training mode (rejection)")
    parser.add_argument("--debate-grpo-reward", choices=["task"], help="rs_grpo's reward: task")
    parser.add_argument("--model", help="built-in name, local folder or hub id (smollm2-135m)")
    parser.add_argument("--log-root", help="root of run directories (RLRUNBOOK_LOG_ROOT, else ./logs)")
    parser.add_argument("--learning-rate", type=float, help="AdamW learning rate (1e-4)")
    parser.add_argument("--lora-rank", type=int, help="LoRA rank (16)")
    parser.add_argument("--summary-max-words", type=int, help="summary: words of the article in the prompt (150)")
    parser.add_argument("--deterministic", action="store_const", const=True,
                        help="seed Python/NumPy/torch and use deterministic torch algorithms")
    parser.add_argument("--expected-dataset-hash", help="refuse the run if the data set's fingerprint differs")
    parser.add_argument("--no-proxy", action="store_true", help="accepted for older run scripts that pass it; no effect")
    parser.add_argument("--loss-fn", help="importance_sampling (default) | ppo | cispo | dro | gspo")
    parser.add_argument("--kl-coef", type=float, help="loss.kl_coef: KL to the reference policy (0 = off)")
    parser.add_argument("--kl-estimator", choices=["k1", "k3", "low_var_kl"], help="loss.kl_estimator (low_var_kl)")
    parser.add_argument("--entropy-coef", type=float, help="loss.entropy_coef: entropy bonus (0 = off)")
    parser.add_argument("--grad-clip-norm", type=float, help="loss.grad_clip_norm: clip the gradient norm (0 = off)")
    parser.add_argument("--checkpoint-every", type=int, help="checkpoint.every: save every N steps (0 = off)")
    parser.add_argument("--val-every", type=int, help="validation.every: pass@k validation every N steps (0 = off)")
    parser.add_argument("--val-samples", type=int, help="validation.samples: samples per validation problem (4)")
    parser.add_argument("--cache-dataset", action="store_const", const=True,
                        help="data.cache: keep a normalised copy of the data set and train from it")
    parser.add_argument("--max-prompt-tokens", type=int, help="data.max_prompt_tokens: refuse longer prompts")
    parser.add_argument("--truncate-prompts", action="store_const", const=True,
                        help="data.truncate_prompts: cut over-long prompts instead of refusing the run")
    parser.add_argument("--blocklist", action="append", help="reward.blocklist: a forbidden substring (repeatable)")
    parser.add_argument("--reject-blocklisted", action="store_const", const=True,
                        help="reward.reject_blocklisted: reward 0 for completions with a blocklisted substring")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _Parser(argparse.ArgumentParser):
    """argparse, reading every negative number as a value: ``--learning-rate -1e-4`` or ``--temperature -inf`` is
    then refused by the option's own check, naming the value, instead of "expected one argument" (argparse
    takes only ``-1`` and ``-.5`` for numbers, and ``-1e-4``, ``-inf`` for options)."""

    def _parse_optional(self, arg_string):
        if arg_string.startswith("-") and arg_string not in self._option_string_actions and _is_number(arg_string):
            return None  # a value (argparse's own answer for the numbers it recognises)
        return super()._parse_optional(arg_string)


def build_parser() -> argparse.ArgumentParser:
    from rlrunbook.models.registry import DEFAULT_MODEL

    parser = _Parser(prog="rlrunbook", description="RL post-training of LoRA policies behind the "
                                     "Tinker API, checked by an executable runbook.")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check-logprobs",
        help="sample, recompute teacher-forced logprobs of the same tokens, fail above the tolerance",
    )
    check.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, local folder or hub id")
    check.add_argument("--prompt", default="What is 7 * 8?")
    limited = _limited()
    check.add_argument("--max-tokens", type=limited["tokens"], default=32)
    check.add_argument("--num-samples", type=limited["samples"], default=4)
    check.add_argument("--temperature", type=float, default=1.0)
    check.add_argument("--top-k", type=int, default=-1)
    check.add_argument("--top-p", type=float, default=1.0)
    check.add_argument("--min-p", type=float, default=0.0)
    check.add_argument("--seed", type=limited["seed"], default=0)
    check.add_argument("--dtype", choices=_DTYPE_NAMES, default=None,
                       help="default: what train uses (TINKER_LOCAL_DTYPE, else bfloat16 on cuda, float32 on cpu)")
    check.add_argument("--device", default=None, help="default: TINKER_LOCAL_DEVICE, else cuda if available, else cpu")
    check.add_argument("--sampler", choices=("hf", "generate", "vllm"), default=None,
                       help="sampling engine (default: TINKER_LOCAL_SAMPLER, else hf); vllm samples through a vLLM "
                            "server (TINKER_LOCAL_VLLM_URL, else one started from .venv-vllm)")
    check.add_argument("--numerics", choices=("invariant", "exact", "native"), default=None,
                       help="how sampler and trainer round (default: TINKER_LOCAL_NUMERICS, else invariant)")
    check.add_argument("--lora-rank", type=limited["rank"], default=16,
                       help="rank of the (fresh) adapter, as train's default")
    check.add_argument("--tolerance", type=_positive_float, default=None,
                       help="max abs logprob gap allowed (default: the gate of the dtype, 1e-4 in float32, 0.1/T in half "
                            "precision, where the mean must also stay <= 0.01/T)")
    check.add_argument("--raw", action="store_true", help="encode the prompt as plain text, no chat template")
    check.set_defaults(func=cmd_check_logprobs)

    train = commands.add_parser("train", help="train a LoRA policy: single-turn GRPO or debate with rejection "
                                              "sampling / RS-GRPO; writes a run directory and checks it")
    _add_train_arguments(train)
    train.add_argument("--resume-from", metavar="RUN_DIR|CHECKPOINT",
                       help="continue a run from its last checkpoint (or the given one) in a new run directory")
    train.add_argument("--service", metavar="URL", type=_service_url,
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
    show.add_argument("--check-logprobs-args", action="store_true",
                      help="print, one per line, the check-logprobs arguments that check what this train command "
                           "runs (model, LoRA rank, temperature, min-p; backend device, dtype, sampler); "
                           "scripts/run.sh uses it")
    show.set_defaults(func=cmd_show_config)

    check_run = commands.add_parser("check-run", help="apply the runbook's rubrics to a run directory; "
                                                      "exit 1 if any check fails")
    check_run.add_argument("run_dir")
    check_run.set_defaults(func=cmd_check_run)

    resolve = commands.add_parser("resolve-model", help="print the local folder a model name resolves to "
                                                        "(building a built-in model on first use)")
    resolve.add_argument("name")
    resolve.set_defaults(func=cmd_resolve_model)
    add_run_tool_commands(commands)
    add_serve_command(commands)
    return parser


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; ``key.sub=value`` overrides of train/show-config may sit anywhere among the flags."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not hasattr(args, "overrides") or not all(_OVERRIDE.match(item) for item in extras):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*args.overrides, *extras]
    return args


def _check_text(argv: Sequence[str]) -> None:
    """``ConfigError`` naming the argument when one holds bytes that are not UTF-8 (Python passes them on as lone
    surrogates, which no file of a run can record and no tokenizer can read)."""
    for position, value in enumerate(argv, start=1):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raw = value.encode("utf-8", "surrogateescape")[error.start:error.start + 1]
            raise ConfigError(f"argument {position} ({value!r}) is not UTF-8 text (byte 0x{raw.hex()} at offset "
                              f"{error.start}). Pass it as UTF-8 (rename a file whose name is in another "
                              "encoding, e.g. with `convmv -f latin1 -t utf-8`).") from None


def _run(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its command; an anticipated error becomes one paragraph (exit 2), any other
    exception a bug report (exit 70): see :mod:`rlrunbook.cli_errors`."""
    try:
        _check_text(sys.argv[1:] if argv is None else argv)
        args = parse_args(argv)
        pending_signal.raise_pending()  # a signal that a module imported so far swallowed
        if argv is not None and getattr(args, "argv", False) is None:
            args.argv = list(argv)  # an in-process caller's command line is what the run records, not sys.argv
        return args.func(args)
    except BrokenPipeError:
        # `rlrunbook summarize ... | head`: the reader left. Point stdout at nothing so the exit flushes quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # as if killed by SIGPIPE, what a shell reports for the other commands of a pipe
    except Exception as error:  # noqa: BLE001 - the boundary: anticipated classes are described, the rest reported
        interrupt = cli_signals.interrupted_by(error)
        if interrupt is not None:  # a signal's KeyboardInterrupt that a library turned into its own error
            raise interrupt from error
        message = cli_errors.describe(error)
        return cli_errors.refuse(message) if message is not None else cli_errors.report_bug(error)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``rlrunbook`` command; its exit status (docs/cli.md): 0 success, 1 its check failed, 2 refused
    (one ``error:`` paragraph), 70 a bug (a traceback and where to report it), 128 + N after signal N.

    SIGTERM and SIGHUP are handled from this function's first line, Ctrl-C as Python does from start-up: each
    stops the command as Ctrl-C does (see :mod:`rlrunbook.cli_signals`), without a traceback.
    """
    pending_signal.acknowledge()  # what an earlier command of this process left is not this command's
    restore = cli_signals.install()
    try:
        try:
            return _run(argv)
        except KeyboardInterrupt as interrupt:
            return cli_signals.finish(interrupt)
    except KeyboardInterrupt as again:  # a second signal while the first was being handled
        return cli_signals.finish_now(again)
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
