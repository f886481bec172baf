"""GRPO in one screen, over the Tinker client API: what `rlrunbook train` does, without its machinery.

    python examples/grpo_loop.py                      # the built-in `tiny` model, 3 steps, on this machine
    python examples/grpo_loop.py --model smollm2-135m --steps 10

Each step: sample a group of completions per prompt from the current weights, score each completion, centre the
scores within its group (the advantage: better or worse than its siblings), train on the sampled tokens with the
importance-sampling loss (each token's advantage times the ratio of learner to sampler probabilities, summed),
take one AdamW step. At the end the adapter is saved for sampling.

The backend is the local one (`TINKER_BACKEND=local`, the default): the same code runs against the hosted Tinker
service with `TINKER_BACKEND=api`. The task here is deliberately tiny and needs no data: answer in exactly five
words. Replace `reward` with a verifier of your own (a math checker, a unit test) for a real task.
"""

from __future__ import annotations

import argparse
import statistics

from tinker import types

from rlrunbook.backend import create_service_client
from rlrunbook.tokens import build_datum_arrays

PROMPTS = [
    "Describe the sea in five words.",
    "Describe a city at night in five words.",
    "Describe your morning in five words.",
    "Describe a forest in five words.",
]
TARGET_WORDS = 5


def reward(completion: str) -> float:
    """1 for exactly five words, less the further the count is from five (0 at ten words off)."""
    return max(0.0, 1.0 - abs(len(completion.split()) - TARGET_WORDS) / 10)


def group_advantages(rewards: list[float]) -> list[float]:
    """Each reward minus its group's mean: GRPO's advantage (without dividing by the spread)."""
    mean = statistics.fmean(rewards)
    return [r - mean for r in rewards]


def datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """One training example: the prompt and completion, shifted by one token, with the sampler's logprobs and the
    advantage on every completion token (zero on the prompt)."""
    arrays = build_datum_arrays(prompt, completion, logprobs, [advantage] * len(completion))
    return types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                       loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                       "advantages": arrays.advantages})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a built-in model, a Hugging Face id or a local folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="completions sampled per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    args = parser.parse_args()

    service = create_service_client()
    training = service.create_lora_training_client(args.model, rank=args.rank, seed=0)
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)

    for step in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client()  # the weights this step samples from
        pending = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        data, rewards = [], []
        for prompt, future in zip(prompts, pending, strict=True):
            sequences = future.result().sequences
            group = [reward(tokenizer.decode(s.tokens)) for s in sequences]
            rewards += group
            for sequence, advantage in zip(sequences, group_advantages(group), strict=True):
                if advantage != 0:  # a tied group teaches nothing: leave it out
                    data.append(datum(prompt, list(sequence.tokens), list(sequence.logprobs), advantage))
        if not data:
            print(f"step {step}: every group tied (reward {statistics.fmean(rewards):.3f}); nothing to train")
            continue
        result = training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=args.learning_rate)).result()
        print(f"step {step}: reward {statistics.fmean(rewards):.3f}, {len(data)} datums, "
              f"loss {result.metrics['loss:sum']:.4f}", flush=True)

    saved = training.save_weights_for_sampler("final").result()
    print(f"saved: {saved.path}")


if __name__ == "__main__":
    main()
