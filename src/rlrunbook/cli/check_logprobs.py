"""``rlrunbook check-logprobs``: sample, recompute the same tokens' logprobs as the trainer, compare."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rlrunbook.cli.arguments import DTYPE_NAMES, limited, positive_float
from rlrunbook.errors import ConfigError


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


def add_command(commands) -> None:
    from rlrunbook.models.registry import DEFAULT_MODEL

    check = commands.add_parser(
        "check-logprobs",
        help="sample, recompute teacher-forced logprobs of the same tokens, fail above the tolerance",
    )
    check.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, local folder or hub id")
    check.add_argument("--prompt", default="What is 7 * 8?")
    bounded = limited()
    check.add_argument("--max-tokens", type=bounded["tokens"], default=32)
    check.add_argument("--num-samples", type=bounded["samples"], default=4)
    check.add_argument("--temperature", type=float, default=1.0)
    check.add_argument("--top-k", type=int, default=-1)
    check.add_argument("--top-p", type=float, default=1.0)
    check.add_argument("--min-p", type=float, default=0.0)
    check.add_argument("--seed", type=bounded["seed"], default=0)
    check.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                       help="default: what train uses (TINKER_LOCAL_DTYPE, else bfloat16 on cuda, float32 on cpu)")
    check.add_argument("--device", default=None, help="default: TINKER_LOCAL_DEVICE, else cuda if available, else cpu")
    check.add_argument("--sampler", choices=("hf", "generate", "vllm"), default=None,
                       help="sampling engine (default: TINKER_LOCAL_SAMPLER, else hf); vllm samples through a vLLM "
                            "server (TINKER_LOCAL_VLLM_URL, else one started from .venv-vllm)")
    check.add_argument("--numerics", choices=("invariant", "exact", "native"), default=None,
                       help="how sampler and trainer round (default: TINKER_LOCAL_NUMERICS, else invariant)")
    check.add_argument("--lora-rank", type=bounded["rank"], default=16,
                       help="rank of the (fresh) adapter, as train's default")
    check.add_argument("--tolerance", type=positive_float, default=None,
                       help="max abs logprob gap allowed (default: the gate of the dtype, 1e-4 in float32, 0.1/T in half "
                            "precision, where the mean must also stay <= 0.01/T)")
    check.add_argument("--raw", action="store_true", help="encode the prompt as plain text, no chat template")
    check.set_defaults(func=cmd_check_logprobs)
