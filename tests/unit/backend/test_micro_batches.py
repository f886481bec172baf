"""forward_backward in micro-batches of a token budget: the split, the gradient, and memory that does not grow.

The split is a pure function of token ids (properties below, by hypothesis). The gradient of a batch trained in
micro-batches equals the one-pass gradient up to fp32 rounding: the loss is a token sum, so only the order of the
additions changes (and a shared prompt cut between two micro-batches is computed twice, each copy adding its
share). Recomputing layer activations in backward replays the same operations, so it changes no bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tinker import types

from rlrunbook.backend.lora import adapter_parameters, wrap_with_lora
from rlrunbook.backend.memory import LiveBytes
from rlrunbook.backend.micro_batches import distinct_tokens, micro_batches
from rlrunbook.backend.trainer import Trainer
from rlrunbook.models import load_causal_lm

sequences_strategy = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=12)


@given(sequences_strategy, st.integers(1, 40), st.integers(1, 4))
def test_the_split_keeps_order_covers_every_datum_once_and_respects_the_budget(sequences, budget, chunks):
    batches = micro_batches(sequences, budget, chunks)
    assert [i for b in batches for i in range(b.start, b.stop)] == list(range(len(sequences)))
    assert len(batches) >= min(chunks, len(sequences))
    for batch in batches:
        part = sequences[batch.start:batch.stop]
        assert batch.tokens == distinct_tokens(part)  # what the shared-prefix pass computes
        assert batch.tokens <= budget or batch.stop - batch.start == 1  # only a lone long datum exceeds it


def test_a_group_sharing_its_prompt_is_counted_once():
    prompt = list(range(10))
    group = [prompt + [20 + i, 30 + i] for i in range(4)]  # 10 shared + 4 x 2 own tokens = 18 distinct
    assert micro_batches(group, 18) == [(0, 4, 18)]
    assert micro_batches(group, 17) == [(0, 3, 16), (3, 4, 12)]  # the fourth no longer fits; its prompt again
    assert micro_batches(group, None, chunks=2) == [(0, 2, 14), (2, 4, 14)]


@pytest.fixture(scope="module")
def tiny_lora(tiny_folder):
    def make(**trainer_options):
        torch.manual_seed(0)
        model = wrap_with_lora(load_causal_lm(tiny_folder, dtype=torch.float32), rank=8, alpha=16, seed=3)
        with torch.no_grad():  # B starts at zero: give the adapter a non-trivial value so every factor has a gradient
            for name, param in adapter_parameters(model).items():
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        return model, Trainer(model, pad_token_id=0, vocab_size=model.config.vocab_size, **trainer_options)
    return make


def _groups(vocab: int, groups: int = 4, samples: int = 4, prompt: int = 40, answer: int = 24) -> list[types.Datum]:
    generator = torch.Generator().manual_seed(7)
    data = []
    for _ in range(groups):
        shared = torch.randint(3, vocab, (prompt,), generator=generator).tolist()
        for _ in range(samples):
            tokens = shared + torch.randint(3, vocab, (answer + 1,), generator=generator).tolist()
            weights = [0.0] * (prompt - 1) + [1.0] * (answer + 1)  # the targets after the prompt
            advantages = torch.randn(len(tokens) - 1, generator=generator) * torch.tensor(weights)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                                "logprobs": types.TensorData.from_torch(-torch.rand(len(tokens) - 1,
                                                                                    generator=generator)
                                                                        * torch.tensor(weights)),
                                "advantages": types.TensorData.from_torch(advantages)}))
    return data


def _gradients(make, data, **options) -> tuple[dict[str, torch.Tensor], dict]:
    model, trainer = make(**options)
    out = trainer.forward_backward(data, "importance_sampling")
    return {name: p.grad.clone() for name, p in adapter_parameters(model).items()}, out.metrics


def test_micro_batches_give_the_one_pass_gradient(tiny_lora):
    data = _groups(719)
    whole, whole_metrics = _gradients(tiny_lora, data)
    split, split_metrics = _gradients(tiny_lora, data, micro_batch_tokens=150)
    assert whole_metrics["micro_batches:sum"] == 1 and split_metrics["micro_batches:sum"] >= 4
    assert split_metrics["micro_batch_tokens:max"] <= 150
    assert split_metrics["loss:sum"] == pytest.approx(whole_metrics["loss:sum"], rel=1e-5)
    for name, grad in whole.items():
        # fp32 sums of ~10^3 terms in another order: |error| <~ n * 2^-24 * sum|terms|; 1e-5 of the largest
        # entry covers it with margin, while a lost or doubled micro-batch moves entries by ~1e-1 of it.
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert torch.allclose(split[name], grad, rtol=0, atol=1e-5 * scale), name


def test_recomputing_layer_activations_changes_no_bit(tiny_lora):
    data = _groups(719)
    kept, kept_metrics = _gradients(tiny_lora, data, micro_batch_tokens=200)
    recomputed, recomputed_metrics = _gradients(tiny_lora, data, micro_batch_tokens=200, recompute_layers=True)
    assert kept_metrics["loss:sum"] == recomputed_metrics["loss:sum"]
    for name, grad in kept.items():
        assert torch.equal(recomputed[name], grad), name


def test_a_pass_that_fits_now_skips_the_planned_recompute(tiny_lora, monkeypatch):
    """Checkpointing chosen by the plan (the plan's share too small) is skipped for a micro-batch whose cost
    without it fits in the memory free when it runs, and kept for one that does not; the gradient is the same
    bits either way."""
    from rlrunbook.backend import memory

    data = _groups(719)
    plain = memory.TokenCost(fixed=0, per_token=1000, recompute_layers=False)
    kept, _ = _gradients(tiny_lora, data, micro_batch_tokens=200, recompute_layers=True)
    sizes = [batch.tokens for batch in micro_batches([d.model_input.to_ints() for d in data], 200)]
    above = sum(size > 160 for size in sizes)
    assert 0 < above < len(sizes), sizes
    for free, recomputed in ((10**12, 0), (1000 * 160, above), (None, len(sizes))):
        monkeypatch.setattr(memory, "available_now", lambda device, free=free: free)
        model, trainer = tiny_lora(micro_batch_tokens=200, recompute_layers=True, plain_cost=plain)
        trainer.forward_backward(data, "importance_sampling")
        assert trainer.recomputed_passes == recomputed, (free, sizes)
        for name, param in adapter_parameters(model).items():
            assert torch.equal(param.grad, kept[name]), (free, name)
    assert memory.needs_recompute(None, 1, "cpu")  # no cost without checkpointing known: keep it


def test_the_memory_free_now_is_read_from_the_device():
    from rlrunbook.backend import memory

    free = memory.available_now("cpu")
    total = memory.device_memory("cpu")
    assert free is not None and -total < free < total
    tiny = memory.TokenCost(fixed=0, per_token=1, recompute_layers=False)
    huge = memory.TokenCost(fixed=0, per_token=2 * total, recompute_layers=False)
    assert not memory.needs_recompute(tiny, 1, "cpu") and memory.needs_recompute(huge, 1, "cpu")


def test_peak_memory_stays_flat_from_one_budget_of_tokens_to_eight(tiny_lora):
    """fp32 on CPU: the tensor memory a forward_backward holds at its peak (every tensor it creates, followed
    until freed) is within 10% for a batch of one budget's worth of distinct tokens and one of eight."""
    budget = 256
    one = _groups(719, groups=1, samples=4, prompt=40, answer=50)  # 40 + 4 x 50 = 240 distinct tokens
    eight = _groups(719, groups=8, samples=4, prompt=40, answer=50)
    peaks = []
    for data in (one, eight):
        model, trainer = tiny_lora(micro_batch_tokens=budget)
        trainer.forward_backward(one, "importance_sampling")  # first pass: stacked weights, caches
        model.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            metrics = trainer.forward_backward(data, "importance_sampling").metrics
        peaks.append(live.peak)
        assert metrics["micro_batch_tokens:max"] <= budget
    assert peaks[1] <= 1.1 * peaks[0], peaks
    # Without the budget the same eight-fold batch holds several times more at once (the mechanism matters here).
    model, trainer = tiny_lora(micro_batch_tokens=None)
    trainer.forward_backward(one, "importance_sampling")
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        trainer.forward_backward(eight, "importance_sampling")
    assert live.peak > 3 * peaks[0], (live.peak, peaks)


@pytest.mark.parametrize(("user", "planned", "expected"), [
    (None, True, ("auto", True, "planned")),  # the plan's checkpointing: skipped where a pass fits
    (None, False, ("off", False, "off")),
    ("on", True, ("on", False, "on")),  # the user's: every pass recomputes
    ("off", False, ("off", False, "off")),
])
def test_a_runs_plan_hands_its_checkpointing_to_the_trainer_as_skippable(monkeypatch, user, planned, expected):
    from types import SimpleNamespace

    from rlrunbook.backend import service_client
    from rlrunbook.rl.setup import service
    from rlrunbook.rl.setup.config import BackendSettings

    made = {}
    monkeypatch.setattr("rlrunbook.backend.create_service_client", lambda settings: made.setdefault("s", settings))
    monkeypatch.setattr("rlrunbook.backend.backend_name", lambda: "local")
    monkeypatch.delenv("TINKER_LOCAL_ACTIVATION_CHECKPOINTING", raising=False)
    plan = SimpleNamespace(micro_batch_tokens=4096, recompute_layers=planned)
    settings = service.default_service(BackendSettings(device="cpu", activation_checkpointing=user), plan)
    assert (settings.activation_checkpointing, settings.planned_recompute,
            service_client._checkpointing(settings)) == expected
    assert settings.micro_batch_tokens == 4096


def test_planned_checkpointing_comes_with_its_cost_without(tiny_folder):
    from rlrunbook.backend import memory

    model = wrap_with_lora(load_causal_lm(tiny_folder, dtype=torch.float32), rank=8, alpha=16, seed=3)
    config, layout = model.get_base_model().config, {"lora_rank": 8, "lora_alpha": 16, "train_attn": True,
                                                     "train_mlp": True, "train_unembed": True}
    choose = lambda checkpointing, tokens: memory.choose_micro_batching(
        config, torch.float32, layout, "invariant", available=10**9, device_type="cpu", tokens=tokens,
        checkpointing=checkpointing, where="test")
    for tokens in (None, 512):
        planned = choose("planned", tokens)
        assert planned.recompute_layers and planned.plain is not None and not planned.plain.recompute_layers
        forced = choose("on", tokens)
        assert forced.recompute_layers and forced.plain is None
