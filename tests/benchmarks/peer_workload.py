"""The peer workload, run by rlrunbook and by TRL's ``GRPOTrainer`` in one process, steps interleaved.

Workload (the same for both): SmolLM2-135M-Instruct (or ``RLRUNBOOK_PEER_MODEL``), 4 chat prompts x 4
samples, at most 64 new tokens (or ``RLRUNBOOK_PEER_SHAPE``: prompts x samples x tokens, up to 16 prompts), T = 1,
top-p 1, stop at EOS; LoRA r = 16, alpha = 32 on the 7
projections (not the output layer); rewards from :func:`reward` (continuous, so groups have spread),
group-centred advantages (not scaled by the std), no KL; one AdamW step per step (lr 1e-5, grad
clip 1.0). fp32 on CPU, bf16 on CUDA. TRL runs with its activation checkpointing off (rlrunbook keeps
activations too) and ``loss_type="dapo"``, its default.

Interleaving: TRL owns its training loop, so each rlrunbook step runs from a ``TrainerCallback``
right after a TRL step ends. Both see the same machine state, allocator and threads; ratios of
medians measured this way hold on shared cores where absolute times swing 2x.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from tinker import types

PROMPTS = (
    "Describe a rainy afternoon in a small town.",
    "Explain why the sky looks blue, in simple words.",
    "Give three tips for learning to play the guitar.",
    "Write a short note thanking a friend for a gift.",
    "Summarise the plot of a film you would like to see.",
    "List five things to pack for a weekend by the sea.",
    "Explain how a bicycle stays upright while moving.",
    "Suggest a name for a bakery and say why it fits.",
    "Describe the view from a window on a winter morning.",
    "Give advice to someone starting their first job.",
    "Explain what a recipe is to a young child.",
    "Write two sentences about a lighthouse keeper.",
    "Compare reading on paper with reading on a screen.",
    "Describe the sounds of a busy market.",
    "Explain why people keep diaries.",
    "Plan a short walk through a park for a visitor.",
)
RANK, ALPHA, LR, CLIP = 16, 32, 1e-5, 1.0
SHAPE_ENV = "RLRUNBOOK_PEER_SHAPE"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def reward(text: str) -> float:
    """Distinct words / 50 (no cap): continuous, so a group of 4 samples almost always has spread."""
    return len(set(text.lower().split())) / 50.0


def peer_model() -> str:
    return os.environ.get("RLRUNBOOK_PEER_MODEL", "smollm2-135m")


@dataclass(frozen=True)
class PeerShape:
    """Prompts per step (the first of ``PROMPTS``), samples per prompt, and new tokens per sample at most."""

    prompts: int = 4
    samples: int = 4
    max_tokens: int = 64

    def __str__(self) -> str:
        return f"{self.prompts}x{self.samples}x{self.max_tokens}"


def peer_shape() -> PeerShape:
    """``RLRUNBOOK_PEER_SHAPE`` (``PROMPTSxSAMPLESxTOKENS``), else 4 x 4 x 64. Refuses more prompts than ``PROMPTS``
    holds, fewer than 2 samples (no group spread), or a malformed value, naming it."""
    raw = os.environ.get(SHAPE_ENV, "").strip()
    if not raw:
        return PeerShape()
    parts = raw.split("x")
    try:
        if len(parts) != 3:
            raise ValueError
        shape = PeerShape(*(int(part) for part in parts))
    except ValueError:
        raise ValueError(f"{SHAPE_ENV}={raw!r}: expected PROMPTSxSAMPLESxTOKENS, e.g. 16x4x256") from None
    if not (1 <= shape.prompts <= len(PROMPTS) and shape.samples >= 2 and shape.max_tokens >= 1):
        raise ValueError(f"{SHAPE_ENV}={raw!r}: 1 to {len(PROMPTS)} prompts, at least 2 samples and 1 token")
    return shape


@dataclass
class Timings:
    """Per-step seconds of one implementation, with the phase split where it is known."""

    steps: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add(self, total: float, **phases: float) -> None:
        self.steps.append(total)
        for name, value in phases.items():
            self.phases.setdefault(name, []).append(value)

    def median(self, skip: int) -> float:
        return statistics.median(self.steps[skip:])

    def phase_medians(self, skip: int) -> dict[str, float]:
        return {name: statistics.median(values[skip:]) for name, values in self.phases.items()}


class RlrunbookPeer:
    """The workload on rlrunbook's local backend, through the Tinker-style clients."""

    def __init__(self, device: str, dtype: torch.dtype, storage, shape: PeerShape | None = None):
        from rlrunbook.backend import LocalServiceClient, LocalSettings
        from rlrunbook.rl.rollout.prompts import render_prompt

        self.service = LocalServiceClient(LocalSettings(device=device, dtype=dtype, lora_alpha=ALPHA,
                                                        storage_dir=storage))
        self.training = self.service.create_lora_training_client(peer_model(), rank=RANK, seed=0,
                                                                 train_unembed=False)
        self.tokenizer = self.training.get_tokenizer()
        self.shape = shape or PeerShape()
        self.prompts = [render_prompt(self.tokenizer, question) for question in PROMPTS[:self.shape.prompts]]
        self.timings = Timings()
        self._step = 0

    @property
    def engine(self):
        return self.training._host.engine

    def step(self) -> None:
        started = time.perf_counter()
        sampler = self.training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=self.shape.max_tokens, temperature=1.0, top_p=1.0, seed=self._step)
        with sampler.batch():
            futures = [sampler.sample(types.ModelInput.from_ints(p), self.shape.samples, params) for p in self.prompts]
        groups = [future.result().sequences for future in futures]
        sampled = time.perf_counter()
        data = []
        for prompt, sequences in zip(self.prompts, groups, strict=True):
            rewards = [reward(self.tokenizer.decode(list(s.tokens), skip_special_tokens=True)) for s in sequences]
            mean = sum(rewards) / len(rewards)
            for sequence, value in zip(sequences, rewards, strict=True):
                if value == mean:
                    continue
                tokens = list(sequence.tokens)
                full = prompt + tokens
                n_prompt = len(prompt) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * n_prompt + list(sequence.logprobs),
                                    "advantages": [0.0] * n_prompt + [value - mean] * len(tokens)}))
        scored = time.perf_counter()
        if data:
            self.training.forward_backward(data, "importance_sampling").result()
        trained = time.perf_counter()
        if data:
            self.training.optim_step(types.AdamParams(learning_rate=LR, grad_clip_norm=CLIP)).result()
        done = time.perf_counter()
        self._step += 1
        self.timings.add(done - started, sample=sampled - started, score=scored - sampled,
                         forward_backward=trained - scored, optimizer=done - trained)

    def close(self) -> None:
        self.service.close()


def trl_trainer(device: str, dtype: torch.dtype, steps: int, callbacks: list, output_dir: str,
                shape: PeerShape | None = None):
    """TRL's GRPOTrainer on the same workload (the model folder rlrunbook resolves, the same LoRA)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rlrunbook.models import load_tokenizer, resolve_model

    folder = resolve_model(peer_model())
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    shape = shape or PeerShape()
    questions = PROMPTS[:shape.prompts]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in questions] * (steps + 2))

    def reward_fn(completions, **_):
        return [reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    args = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=len(questions) * shape.samples,
        num_generations=shape.samples, max_completion_length=shape.max_tokens, temperature=1.0, top_p=1.0, learning_rate=LR, max_grad_norm=CLIP,
        beta=0.0, scale_rewards="none", max_steps=steps, gradient_checkpointing=False, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", bf16=dtype == torch.bfloat16,
        lr_scheduler_type="constant", warmup_steps=0, dataloader_num_workers=0, seed=0, shuffle_dataset=False,
    )
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    return GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                       processing_class=tokenizer, peft_config=lora, callbacks=callbacks)


class GenerateTimer:
    """Seconds spent inside transformers' ``generate`` (TRL's sampling phase) while installed."""

    def __init__(self):
        from transformers import GenerationMixin

        self.seconds = 0.0
        self._cls = GenerationMixin
        self._original = GenerationMixin.generate

    def __enter__(self):
        timer, original = self, self._original

        def timed(model, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(model, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - started

        self._cls.generate = timed
        return self

    def __exit__(self, *exc):
        self._cls.generate = self._original
