"""Where one LoRA ``forward_backward`` spends its time on CPU, by fixed-order kernel call and shape.

A LoRA training client of ``--model`` trains a batch shaped like the peer workload (``--prompts`` groups of
``--samples`` sequences, each a prompt of ``--prompt-tokens`` and ``--new-tokens`` trained tokens, random ids,
importance-sampling loss). After a warm-up call, one ``forward_backward`` is timed with every call of the CPU
kernels (products, attention) timed as well, and printed by total time: the kernel, its operands' shapes, the
calls and seconds, then the time outside the kernels:

    python scripts/profile_training_kernels.py --model smollm2-135m

Shapes name the product ``a [M, K]`` with ``b [N, K]`` (``gemm_nt``) or ``b [K, N]`` (``gemm_seq``), and the
attention's queries ``[R, T, H, D]`` with keys ``[R, S, Hkv, D]``.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.kernels import cpu

KERNELS = ("gemm_nt", "gemm_seq", "attention_forward", "attention_backward")


def batch(vocab: int, prompts: int, samples: int, prompt_tokens: int, new_tokens: int) -> list[types.Datum]:
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(prompts):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=generator).tolist()
        for _ in range(samples):
            tokens = prompt + torch.randint(10, vocab, (new_tokens,), generator=generator).tolist()
            trained = torch.tensor([0.0] * (prompt_tokens - 1) + [1.0] * new_tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                "logprobs": types.TensorData.from_torch(-torch.rand(len(trained), generator=generator) * trained),
                "advantages": types.TensorData.from_torch(torch.randn(len(trained), generator=generator) * trained)}))
    return data


def profile(model: str, rank: int, data: list[types.Datum]) -> tuple[float, dict, dict]:
    """(seconds of the timed call, its metrics, {(kernel, shapes): [calls, seconds]})."""
    calls: dict = collections.defaultdict(lambda: [0, 0.0])
    originals = {name: getattr(cpu, name) for name in KERNELS}

    def timed(name):
        def run(a, b, *args, **kwargs):
            started = time.perf_counter()
            result = originals[name](a, b, *args, **kwargs)
            entry = calls[(name, tuple(a.shape), tuple(b.shape))]
            entry[0] += 1
            entry[1] += time.perf_counter() - started
            return result
        return run

    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32))
    try:
        training = service.create_lora_training_client(model, rank=rank)
        training.forward_backward(data, "importance_sampling").result()  # warm-up: stacked weights, caches
        for name in KERNELS:
            setattr(cpu, name, timed(name))
        started = time.perf_counter()
        output = training.forward_backward(data, "importance_sampling").result()
        seconds = time.perf_counter() - started
    finally:
        for name, function in originals.items():
            setattr(cpu, name, function)
        service.close()
    return seconds, output.metrics, dict(calls)


def report(seconds: float, metrics: dict, calls: dict, top: int) -> str:
    inside = sum(entry[1] for entry in calls.values())
    lines = [f"forward_backward {seconds:.3f} s ({metrics.get('micro_batches:sum', 1):.0f} micro-batch(es) of at most "
             f"{metrics.get('micro_batch_tokens:max', 0):.0f} distinct tokens): kernels {inside:.3f} s, outside "
             f"them {seconds - inside:.3f} s",
             "   seconds  calls  kernel  shapes"]
    for (name, a, b), (count, spent) in sorted(calls.items(), key=lambda item: -item[1][1])[:top]:
        lines.append(f"  {spent:8.3f}  {count:5d}  {name}  {list(a)} x {list(b)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    from rlrunbook.models import resolve_model
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size
    data = batch(vocab, args.prompts, args.samples, args.prompt_tokens, args.new_tokens)
    print(report(*profile(args.model, args.rank, data), args.top))


if __name__ == "__main__":
    main()
