"""The ``rlrunbook`` command.

    rlrunbook check-logprobs --model tiny --prompt "What is 7 * 8?" --max-tokens 32
    rlrunbook resolve-model smollm2-135m
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from rlrunbook.errors import RlrunbookError

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _encode_prompt(tokenizer, text: str, raw: bool) -> list[int]:
    """Token ids of ``text`` as a user turn (chat template), or as plain text with ``raw``."""
    if not raw and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


def cmd_check_logprobs(args: argparse.Namespace) -> int:
    import torch

    from rlrunbook.backend.host import load_host
    from rlrunbook.backend.sampling_client import resolve_stop
    from rlrunbook.backend.settings import LocalSettings
    from rlrunbook.diagnostics import default_tolerance, logprob_parity
    from rlrunbook.engines.base import GenerationRequest
    from rlrunbook.engines.filters import SamplingFilters

    # Validate every option before the (slow) model load.
    request = GenerationRequest(
        max_tokens=args.max_tokens,
        filters=SamplingFilters(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p),
        seed=args.seed,
    )
    dtype = getattr(torch, args.dtype)
    settings = LocalSettings(dtype=dtype, **({"device": args.device} if args.device else {}))
    print(f"[check-logprobs] loading {args.model} ({args.dtype} on {settings.device})", flush=True)
    host = load_host(args.model, settings)
    prompt = _encode_prompt(host.tokenizer, args.prompt, args.raw)
    request = dataclasses.replace(request, stop=resolve_stop(None, host.eos_token_ids))
    tolerance = args.tolerance if args.tolerance is not None else default_tolerance(dtype)
    report = logprob_parity(host.engine, [prompt], request, num_samples=args.num_samples, tolerance=tolerance)
    print(f"prompt tokens: {len(prompt)}  sampled tokens: {report.num_tokens} "
          f"in {len(report.completions)} completion(s)")
    if report.completions:
        print(f"first completion: {host.tokenizer.decode(report.completions[0])!r}")
    print(f"max_abs_diff: {report.max_abs_diff:.3e}")
    print(f"mean_abs_diff: {report.mean_abs_diff:.3e}")
    print(f"tolerance: {tolerance:.1e} (max |sampled - teacher-forced| logprob, {args.dtype})")
    if report.ok:
        print("ok")
        return 0
    print("FAIL: Logprob mismatch: the sampler and the trainer disagree on the same tokens; "
          "do not train until this is fixed.", file=sys.stderr)
    return 1


def cmd_resolve_model(args: argparse.Namespace) -> int:
    from rlrunbook.models import resolve_model

    print(resolve_model(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rlrunbook.models.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="rlrunbook", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check-logprobs",
        help="sample, recompute teacher-forced logprobs of the same tokens, fail above the tolerance",
    )
    check.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, local folder or hub id")
    check.add_argument("--prompt", default="What is 7 * 8?")
    check.add_argument("--max-tokens", type=int, default=32)
    check.add_argument("--num-samples", type=int, default=4)
    check.add_argument("--temperature", type=float, default=1.0)
    check.add_argument("--top-k", type=int, default=-1)
    check.add_argument("--top-p", type=float, default=1.0)
    check.add_argument("--min-p", type=float, default=0.0)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--dtype", choices=_DTYPE_NAMES, default="float32")
    check.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    check.add_argument("--tolerance", type=float, default=None,
                       help="max abs logprob gap allowed (default 1e-4 in float32, 5e-2 in half precision)")
    check.add_argument("--raw", action="store_true", help="encode the prompt as plain text, no chat template")
    check.set_defaults(func=cmd_check_logprobs)

    resolve = commands.add_parser("resolve-model", help="print the local folder a model name resolves to "
                                                        "(building a built-in model on first use)")
    resolve.add_argument("name")
    resolve.set_defaults(func=cmd_resolve_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RlrunbookError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
