"""Both in-process engines (``hf``, ``generate``) against one contract: exact logprobs, stop handling,
padding, seeds, bad input; and the ``generate`` engine's leak check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrunbook.diagnostics import FP32_TOLERANCE, logprob_parity
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.generate import GenerateEngine
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.errors import ConfigError, GenerationLeakError, InputError


def chat_prompts(host, questions):
    tok = host.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for q in questions]


QUESTIONS = ["What is 7 * 8?", "Hi", "Name three colours of the rainbow, please.", "2+2?",
             "Write one short sentence about the sea and the sky at night.", "Why?", "What is 12 - 5?",
             "Tell me a very short story about a cat who learns to count to ten."]


@pytest.fixture(scope="module", params=["hf", "generate"])
def engine(request, tiny_host):
    """Each engine over the shared tiny model (fp32, CPU)."""
    cls = HFSamplingEngine if request.param == "hf" else GenerateEngine
    tok = tiny_host.tokenizer
    return cls(tiny_host.model, pad_token_id=tok.pad_token_id, vocab_size=tiny_host.model.config.vocab_size,
               max_context=tiny_host.model.config.max_position_embeddings,
               decode_batch=lambda rows: tok.batch_decode(rows, skip_special_tokens=False))


@pytest.fixture(scope="module")
def prompts8(tiny_host):
    prompts = chat_prompts(tiny_host, QUESTIONS)
    assert len({len(p) for p in prompts}) >= 6, "the parity batch must mix prompt lengths"
    return prompts


@pytest.mark.parametrize("filters", [SamplingFilters(temperature=1.0),
                                     SamplingFilters(temperature=0.7, top_p=0.9),
                                     SamplingFilters(temperature=1.3, top_k=20, min_p=0.05),
                                     SamplingFilters(temperature=0.0)],
                         ids=["t1.0", "t0.7-top_p0.9", "t1.3-top_k20-min_p0.05", "greedy"])
def test_parity_tiny_fp32(engine, tiny_host, prompts8, filters):
    request = GenerationRequest(max_tokens=24, filters=filters, stop=(), seed=0)
    report = logprob_parity(engine, prompts8, request, num_samples=2)
    assert report.num_tokens == 8 * 2 * 24
    assert report.max_abs_diff <= FP32_TOLERANCE, report


def test_sampled_logprobs_differ_from_policy_under_temperature(engine, tiny_host, prompts8):
    """At T = 0.7 the sampled distribution is not the policy: the two logprob lists must differ."""
    request = GenerationRequest(max_tokens=8, filters=SamplingFilters(temperature=0.7), stop=(), seed=1)
    (completions,) = engine.sample(prompts8[:1], 1, request)
    c = completions[0]
    gap = (torch.tensor(c.logprobs) - torch.tensor(c.policy_logprobs)).abs().max()
    assert gap > 1e-2
    (tf,) = teacher_forced_logprobs(tiny_host.model, [prompts8[0] + c.tokens], tiny_host.pad_token_id)
    assert torch.allclose(tf[len(prompts8[0]) - 1:], torch.tensor(c.policy_logprobs), atol=FP32_TOLERANCE)


def test_model_generation_defaults_do_not_leak(tiny_folder):
    """A checkpoint whose generation_config sets repetition_penalty etc. samples the plain distribution."""
    from rlrunbook.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(tiny_folder)
    tok = load_tokenizer(tiny_folder)
    gc = model.generation_config
    gc.repetition_penalty, gc.no_repeat_ngram_size, gc.typical_p, gc.top_k = 1.3, 2, 0.5, 7
    request = GenerationRequest(max_tokens=24, filters=SamplingFilters(temperature=1.0), stop=(), seed=0)
    for cls in (GenerateEngine, HFSamplingEngine):
        engine = cls(model, pad_token_id=tok.pad_token_id, vocab_size=model.config.vocab_size)
        report = logprob_parity(engine, [[5, 6, 7, 8], [9, 10]], request, num_samples=2)
        assert report.max_abs_diff <= FP32_TOLERANCE, cls


def test_leak_check_rejects_a_processor_nobody_asked_for(tiny_host, prompts8, monkeypatch):
    """The run-time check: if generate applies any processor before the sampler, sampling refuses."""
    from rlrunbook.engines import generate

    real = generate.neutral_generation_config
    monkeypatch.setattr(generate, "neutral_generation_config", lambda **kw: real(**{**kw, "repetition_penalty": 1.3}))
    engine = GenerateEngine(tiny_host.model, pad_token_id=tiny_host.pad_token_id, vocab_size=719)
    with pytest.raises(GenerationLeakError, match="repetition_penalty"):
        engine.sample(prompts8[:2], 1, GenerationRequest(max_tokens=4, stop=()))


def test_hf_engine_leak_check_rejects_a_filter_nobody_asked_for(tiny_host, prompts8, monkeypatch):
    """The hf engine asserts (on the first step of every block of draws) that, without filters, the sampled scores
    are logits / T."""
    from rlrunbook.engines import hf

    engine = HFSamplingEngine(tiny_host.model, pad_token_id=tiny_host.pad_token_id, vocab_size=719)
    real = hf.apply_filters
    monkeypatch.setattr(hf, "apply_filters", lambda logits, f: real(logits, f) * 1.01)
    with pytest.raises(GenerationLeakError, match="logits / T"):
        engine.sample(prompts8[:2], 1, GenerationRequest(max_tokens=4, filters=SamplingFilters(0.7), stop=()))


def test_a_seeded_row_does_not_depend_on_its_batch(engine, tiny_host, prompts8):
    """Coalescing requests into one generate call must not change what a seeded caller gets."""
    from rlrunbook.engines.base import SampleJob

    request = GenerationRequest(max_tokens=12, filters=SamplingFilters(temperature=1.0), stop=(), seed=42)
    alone = engine.sample_jobs([SampleJob(prompts8[0], 3, request)])[0]
    others = [SampleJob(p, 2, GenerationRequest(12, request.filters, (), 7 + i)) for i, p in enumerate(prompts8[1:])]
    together = engine.sample_jobs([*others[:3], SampleJob(prompts8[0], 3, request), *others[3:]])[3]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    assert len({tuple(c.tokens) for c in alone}) == 3, "the samples of one job differ from each other"


def test_sampling_frequencies_match_the_distribution(engine, tiny_host, prompts8):
    """Gumbel-max draws are exact: first-token frequencies over 4000 seeds match softmax(logits / T)."""
    filters = SamplingFilters(temperature=0.8, top_k=6)
    request = GenerationRequest(max_tokens=1, filters=filters, stop=(), seed=123)
    (samples,) = engine.sample([prompts8[0]], 4000, request)
    counts = torch.bincount(torch.tensor([c.tokens[0] for c in samples]), minlength=engine.vocab_size)
    (logits,) = tiny_host.model(input_ids=torch.tensor([prompts8[0]])).logits[:, -1].detach()
    from rlrunbook.engines.filters import sampling_logprobs

    probs = sampling_logprobs(logits, filters).exp()
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(probs).flatten().tolist())
    expected = probs * 4000
    kept = expected > 0
    chi2 = (((counts[kept] - expected[kept]) ** 2) / expected[kept]).sum().item()
    assert chi2 < 25.7, f"chi-square {chi2:.1f} with {int(kept.sum()) - 1} degrees of freedom (p < 1e-4 at 5 dof)"
    for c in samples[:20]:  # the reported logprob is the drawn token's probability under that distribution
        assert c.logprobs[0] == pytest.approx(probs[c.tokens[0]].log().item(), abs=1e-5)


def _stop_request(stop, max_tokens=24, seed=3):
    return GenerationRequest(max_tokens=max_tokens, filters=SamplingFilters(temperature=1.0), stop=stop, seed=seed)


def test_single_and_multi_token_stops_in_a_batch(engine, tiny_host, prompts8):
    # Learn which tokens the model emits first, then stop on them: every row stops exactly there.
    free = engine.sample(prompts8, 1, _stop_request(()))
    for completions, prompt in zip(free, prompts8, strict=True):
        tokens = completions[0].tokens
        assert len(tokens) == 24 and completions[0].stop_reason == "length"
    single = tuple(sorted({(c[0].tokens[2],) for c in free}))
    multi = tuple(sorted({tuple(c[0].tokens[3:5]) for c in free}))
    for stops in (single, multi):
        again = engine.sample(prompts8, 1, _stop_request(stops))
        for completions in again:
            c = completions[0]
            assert c.stop_reason == "stop"
            assert any(tuple(c.tokens[-len(s):]) == s for s in stops), "ends with a stop sequence"
            assert len(c.tokens) == len(c.logprobs) == len(c.policy_logprobs)
            prefix = c.tokens[:-1]
            assert not any(tuple(prefix[i:i + len(s)]) == s for s in stops for i in range(len(prefix)))


def test_no_stop_runs_to_max_tokens(engine, tiny_host, prompts8):
    eos = tuple((i,) for i in tiny_host.eos_token_ids)
    # Greedy on an eos prompt would stop at once if EOS were active; with stop=() it must not.
    results = engine.sample(prompts8[:3], 2, _stop_request((), max_tokens=40))
    assert all(len(c.tokens) == 40 and c.stop_reason == "length" for cs in results for c in cs)
    assert eos  # the tokenizer has an eos to disable


def test_same_seed_same_samples_different_seed_differs(engine, tiny_host, prompts8):
    a = engine.sample(prompts8[:2], 2, _stop_request((), seed=11))
    b = engine.sample(prompts8[:2], 2, _stop_request((), seed=11))
    c = engine.sample(prompts8[:2], 2, _stop_request((), seed=12))
    tokens = lambda r: [x.tokens for cs in r for x in cs]
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.lists(st.integers(3, 400), min_size=1, max_size=12),
       others=st.lists(st.lists(st.integers(3, 400), min_size=1, max_size=30), min_size=1, max_size=4))
def test_left_padding_invariance(engine, tiny_host, target, others):
    """A prompt's greedy completion and its logprobs do not depend on what else shares the batch."""
    request = GenerationRequest(max_tokens=6, filters=SamplingFilters(temperature=0.0), stop=())
    (alone,) = engine.sample([target], 1, request)
    batched = engine.sample([*others, target], 1, request)[-1]
    assert batched[0].tokens == alone[0].tokens
    assert torch.allclose(torch.tensor(batched[0].logprobs), torch.tensor(alone[0].logprobs), atol=FP32_TOLERANCE)


@pytest.mark.parametrize("prompts, error, match", [
    ([[]], InputError, "empty"),
    ([[1, 2, 10**7]], InputError, "outside the vocabulary"),
    ([], InputError, "no prompts"),
])
def test_bad_prompts_are_named(engine, tiny_host, prompts, error, match):
    with pytest.raises(error, match=match):
        engine.sample(prompts, 1, GenerationRequest(max_tokens=4))


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_non_positive_max_tokens(max_tokens):
    with pytest.raises(ConfigError, match="max_tokens"):
        GenerationRequest(max_tokens=max_tokens)


def test_prompt_longer_than_context(engine, tiny_host):
    too_long = [5] * (engine.max_context + 1)
    with pytest.raises(InputError, match="exceeds the model's context"):
        engine.sample([too_long], 1, GenerationRequest(max_tokens=4))


def test_boundary_flips_are_counted_apart_from_gaps(engine, tiny_host, prompts8, monkeypatch):
    """A token the recomputation filters out (-inf) is a boundary flip, not an infinite gap."""
    from rlrunbook import diagnostics

    real = diagnostics.teacher_forced_logprobs

    def one_flip(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0][-1] = float("-inf")
        return out

    monkeypatch.setattr(diagnostics, "teacher_forced_logprobs", one_flip)
    request = GenerationRequest(max_tokens=8, filters=SamplingFilters(temperature=0.7, top_p=0.9), stop=(), seed=0)
    strict = logprob_parity(engine, prompts8[:2], request)
    assert strict.boundary_flips == 1 and strict.max_abs_diff <= FP32_TOLERANCE and not strict.ok
    lenient = logprob_parity(engine, prompts8[:2], request, max_flip_fraction=0.1)
    assert lenient.ok


def test_prefix_sharing_and_the_pool_change_no_token(tiny_host, prompts8):
    """fp32, fixed seeds: the hf engine (prompts prefilled once per distinct prefix, a second call
    reusing the first call's keys and values) samples exactly the tokens of the plain generate path,
    with every logprob within 1e-5."""
    tok = tiny_host.tokenizer
    common = dict(pad_token_id=tok.pad_token_id, vocab_size=tiny_host.model.config.vocab_size)
    shared = HFSamplingEngine(tiny_host.model, **common)
    plain = GenerateEngine(tiny_host.model, **common)
    request = GenerationRequest(max_tokens=12, filters=SamplingFilters(temperature=1.0), stop=(), seed=9)
    from rlrunbook.engines.base import SampleJob

    round1 = [SampleJob(p, 3, request) for p in prompts8[:4]] + [SampleJob(prompts8[0], 2, request)]
    first = shared.sample_jobs(round1, weights_key="w")
    assert _close(first, plain.sample_jobs(round1))
    prefilled = shared.prefill_tokens
    assert prefilled == len({tuple(p[:t + 1]) for p in prompts8[:4] for t in range(len(p))})
    # round 2 extends each round-1 sample, as a debate's next round does: only the new tokens are prefilled
    round2 = [SampleJob(job.prompt + c.tokens + [5, 6], 1, request) for job, cs in zip(round1, first, strict=True)
              for c in cs]
    second = shared.sample_jobs(round2, weights_key="w")
    assert _close(second, plain.sample_jobs(round2))
    assert shared.prefill_tokens - prefilled <= 3 * len(round2), "the earlier rounds' keys were reused"


def _close(a, b) -> bool:
    for xs, ys in zip(a, b, strict=True):
        for x, y in zip(xs, ys, strict=True):
            assert x.tokens == y.tokens and x.stop_reason == y.stop_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-5
    return True
