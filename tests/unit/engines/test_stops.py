"""Stop strings: matched on the decoded text of each row's generated tokens, tokens end where the string completes.

Expected ends are derived independently of the engine's tail-window criterion: the smallest ``i``
such that the full decode of the row's first ``i`` generated tokens contains the string. Rows are
seeded per row, so a row stopped early generated exactly the prefix of its unstopped twin.
"""

from __future__ import annotations

import pytest
from tinker import types

from rlrunbook.backend.sampling_client import resolve_stop, resolve_stop_conditions
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.errors import ConfigError

EOS = [2]
PROMPTS = [[5, 17, 42, 9, 11], [7, 8, 9], [30, 31, 32, 33, 34, 35, 36], [12], [100, 200, 300, 301]]


def decode(host, tokens):
    return host.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def first_completion(host, tokens, string):
    """End (exclusive) of the first prefix of ``tokens`` whose text contains ``string``, else None."""
    for end in range(1, len(tokens) + 1):
        if string in decode(host, tokens[:end]):
            return end
    return None


def request(stop_strings=(), stop=(), max_tokens=24, seed=5):
    return GenerationRequest(max_tokens=max_tokens, filters=SamplingFilters(temperature=1.0), stop=stop, seed=seed,
                             stop_strings=tuple(stop_strings))


@pytest.mark.parametrize("stop, expected", [
    (None, (((2,),), ())),
    ([], ((), ())),
    ([4, 9], (((4,), (9,)), ())),
    ("\n\nUser:", (((2,),), ("\n\nUser:",))),
    (["ab", "cd", "ab"], (((2,),), ("ab", "cd"))),  # duplicates dropped; EOS still stops, as on the service
])
def test_resolve_stop_conditions(stop, expected):
    assert resolve_stop_conditions(stop, EOS) == expected


@pytest.mark.parametrize("stop, match", [
    (["\n", 5], "mixes stop strings and token ids"),
    ([5, "\n"], "mixes stop strings and token ids"),
    ([""], "empty stop string"),
    ([True], "neither a token id"),
    ({"a": 1}, "must be None"),
])
def test_bad_stops_are_named(stop, match):
    with pytest.raises(ConfigError, match=match):
        resolve_stop_conditions(stop, EOS)


def test_token_only_resolver_refuses_strings():
    assert resolve_stop([3], EOS) == ((3,),)
    with pytest.raises(ConfigError, match="stop strings need a sampling client"):
        resolve_stop(["x"], EOS)


@pytest.fixture(scope="module")
def free_rows(tiny_host):
    """Each prompt's unstopped 24-token sample (seeded), with its text."""
    results = tiny_host.engine.sample(PROMPTS, 1, request())
    rows = [r[0].tokens for r in results]
    assert all(len(t) == 24 for t in rows)
    return rows


@pytest.mark.parametrize("span", [(3, 5), (0, 1), (10, 18)], ids=["mid-2-tokens", "first-token", "8-tokens"])
def test_row_ends_at_the_token_completing_the_string(tiny_host, free_rows, span):
    """A string taken from inside row 0's text: every row ends where (and only if) its own text completes it."""
    lo, hi = span
    string = decode(tiny_host, free_rows[0][lo:hi]).strip() or decode(tiny_host, free_rows[0][lo:hi])
    assert string, "the span must decode to some text"
    stopped = tiny_host.engine.sample(PROMPTS, 1, request(stop_strings=[string]))
    for free, result in zip(free_rows, stopped, strict=True):
        c = result[0]
        end = first_completion(tiny_host, free, string)
        if end is None:
            assert c.tokens == free and c.stop_reason == "length"
        else:
            assert c.tokens == free[:end] and c.stop_reason == "stop"
            assert string in decode(tiny_host, c.tokens) and string not in decode(tiny_host, c.tokens[:-1])
        assert len(c.tokens) == len(c.logprobs) == len(c.policy_logprobs)
    assert stopped[0][0].stop_reason == "stop"


def test_earliest_of_token_and_string_stops_wins(tiny_host, free_rows):
    row = free_rows[0]
    late_string = decode(tiny_host, row[12:14])
    token_stop = ((row[4],),)
    (result,) = tiny_host.engine.sample(PROMPTS[:1], 1, request(stop_strings=[late_string], stop=token_stop))
    expected = min(e for e in (row.index(row[4]) + 1, first_completion(tiny_host, row, late_string)) if e)
    assert result[0].tokens == row[:expected] and result[0].stop_reason == "stop"


def test_string_never_produced_runs_to_max_tokens(tiny_host, free_rows):
    results = tiny_host.engine.sample(PROMPTS, 1, request(stop_strings=["\u2603 never \u2603"]))
    assert [r[0].tokens for r in results] == free_rows
    assert all(r[0].stop_reason == "length" for r in results)


def test_special_token_text_matches_the_special_token(tiny_host):
    """Special tokens are decoded as written, so the string '<|im_end|>' stops on the <|im_end|> token."""
    im_end = tiny_host.tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_id = tiny_host.engine.sample(PROMPTS, 4, request(stop=((im_end,),), max_tokens=40, seed=9))
    by_text = tiny_host.engine.sample(PROMPTS, 4, request(stop_strings=["<|im_end|>"], max_tokens=40, seed=9))
    assert [[c.tokens for c in r] for r in by_id] == [[c.tokens for c in r] for r in by_text]


def test_engine_without_decoder_refuses_strings(tiny_host):
    engine = HFSamplingEngine(tiny_host.model, pad_token_id=tiny_host.pad_token_id,
                              vocab_size=tiny_host.engine.vocab_size)
    with pytest.raises(ConfigError, match="need a decoder"):
        engine.sample(PROMPTS[:1], 1, request(stop_strings=["x"]))


def test_sampling_client_stop_strings_and_batching(local_service, tiny_host, free_rows):
    """Through the SDK surface: strings stop, and requests with the same strings share one engine call."""
    sampler = local_service.create_sampling_client(base_model="tiny")
    string = decode(tiny_host, free_rows[0][3:5])
    worker = local_service._worker
    before = worker.batches_run
    params = [types.SamplingParams(max_tokens=24, temperature=1.0, seed=40 + i, stop=[string]) for i in range(3)]
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, sp) for p, sp in zip(PROMPTS, params)]
    other = sampler.sample(types.ModelInput.from_ints(PROMPTS[3]), 2,
                           types.SamplingParams(max_tokens=24, temperature=1.0, seed=1, stop=["zz"]))
    responses = [f.result() for f in futures]
    other.result()
    assert worker.batches_run - before == 2, "same strings batch together; different strings do not"
    for response in responses:
        for seq in response.sequences:
            text = decode(tiny_host, seq.tokens)
            if seq.stop_reason == "stop" and seq.tokens[-1] not in tiny_host.eos_token_ids:
                assert string in text and string not in decode(tiny_host, seq.tokens[:-1])
            else:
                assert string not in text


def test_short_string_late_in_a_long_generation(tiny_host):
    """Generation longer than the decoded tail window: the match is still found at its completing token."""
    long_request = request(max_tokens=64, seed=21)
    free = [r[0].tokens for r in tiny_host.engine.sample(PROMPTS, 1, long_request)]
    string = decode(tiny_host, free[2][50:51])
    assert 0 < len(string) <= 6, "a short string keeps the window (4 * len + 8 tokens) shorter than 64"
    stopped = tiny_host.engine.sample(PROMPTS, 1, request(stop_strings=[string], max_tokens=64, seed=21))
    for row, result in zip(free, stopped, strict=True):
        end = first_completion(tiny_host, row, string)
        assert result[0].tokens == (row if end is None else row[:end])
    assert first_completion(tiny_host, free[2], string) is not None
