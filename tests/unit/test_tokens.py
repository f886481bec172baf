"""Tests of rlrunbook.tokens: the one-token shift, its inverse, stop handling, padding, vocabulary checks.

Properties run on random token lists (Hypothesis); the stop-sequence checks compare against a brute-force
reference written differently from the module (scan every prefix, ask whether it ends with a stop).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from rlrunbook.errors import InputError
from rlrunbook.tokens import (
    DatumArrays,
    build_datum_arrays,
    check_token_ids,
    find_stop,
    pad_batch,
    split_datum_arrays,
    truncate_at_stop,
)

PROPERTY = settings(max_examples=200, deadline=None)
TOKEN = st.integers(0, 1000)
TOKENS = st.lists(TOKEN, min_size=1, max_size=40)
FLOAT = st.floats(allow_nan=False, allow_infinity=False, width=64)
FIELDS = ["input_tokens", "target_tokens", "weights", "logprobs", "advantages"]


@st.composite
def datums(draw):
    """A prompt, a completion and per-completion logprobs/advantages of the completion's length."""
    prompt = draw(TOKENS)
    completion = draw(TOKENS)
    n = len(completion)
    logprobs = draw(st.lists(FLOAT, min_size=n, max_size=n))
    advantages = draw(st.lists(FLOAT, min_size=n, max_size=n))
    return prompt, completion, logprobs, advantages


# ---------------------------------------------------------------------------------------------------------
# build_datum_arrays / split_datum_arrays
# ---------------------------------------------------------------------------------------------------------


def test_build_datum_arrays_hand_example():
    # s = prompt + completion = [10, 11, 12] + [20, 21]  (P = 3, C = 2, P + C - 1 = 4 positions)
    #   input  = s[:-1] = [10, 11, 12, 20]
    #   target = s[1:]  = [11, 12, 20, 21]   -> the completion [20, 21] is the last C = 2 targets
    arrays = build_datum_arrays([10, 11, 12], [20, 21], [-0.5, -1.5], [2.0, 3.0])
    assert arrays.input_tokens == [10, 11, 12, 20]
    assert arrays.target_tokens == [11, 12, 20, 21]
    assert arrays.weights == [0.0, 0.0, 1.0, 1.0]
    assert arrays.logprobs == [0.0, 0.0, -0.5, -1.5]
    assert arrays.advantages == [0.0, 0.0, 2.0, 3.0]


def test_build_datum_arrays_one_token_prompt_has_no_prompt_targets():
    # P = 1: nothing of the prompt is ever a target, so every one of the P + C - 1 = C positions is weighted.
    arrays = build_datum_arrays([7], [8, 9])
    assert arrays.input_tokens == [7, 8]
    assert arrays.target_tokens == [8, 9]
    assert arrays.weights == [1.0, 1.0]


def test_build_datum_arrays_defaults_are_supervised_weights():
    # No logprobs -> 0 on the completion; no advantages -> 1 (plain supervised learning).
    arrays = build_datum_arrays([1, 2], [3, 4, 5])
    assert arrays.logprobs == [0.0] * 4
    assert arrays.advantages == [0.0, 1.0, 1.0, 1.0]


@PROPERTY
@given(datums())
def test_build_datum_arrays_alignment(datum):
    prompt, completion, logprobs, advantages = datum
    P, C = len(prompt), len(completion)
    arrays = build_datum_arrays(prompt, completion, logprobs, advantages)
    n = P + C - 1
    for field in FIELDS:
        assert len(getattr(arrays, field)) == n, field
    assert arrays.input_tokens[1:] == arrays.target_tokens[:-1]
    assert arrays.input_tokens == (prompt + completion)[:-1]
    assert arrays.target_tokens[n - C:] == completion
    assert arrays.weights == [0.0] * (P - 1) + [1.0] * C
    # The per-completion values sit exactly under the completion's targets, zero elsewhere.
    assert arrays.logprobs[: P - 1] == [0.0] * (P - 1)
    assert arrays.logprobs[P - 1:] == logprobs
    assert arrays.advantages[: P - 1] == [0.0] * (P - 1)
    assert arrays.advantages[P - 1:] == advantages


@PROPERTY
@given(datums())
def test_split_inverts_build(datum):
    prompt, completion, logprobs, advantages = datum
    split = split_datum_arrays(build_datum_arrays(prompt, completion, logprobs, advantages))
    assert split.prompt_tokens == prompt
    assert split.completion_tokens == completion
    assert split.completion_logprobs == logprobs
    assert split.completion_advantages == advantages


@pytest.mark.parametrize("field", FIELDS)
def test_split_rejects_unequal_lengths(field):
    arrays = build_datum_arrays([1, 2, 3], [4, 5])
    shorter = dataclasses.replace(arrays, **{field: getattr(arrays, field)[:-1]})
    with pytest.raises(InputError, match="differ in length"):
        split_datum_arrays(shorter)


@PROPERTY
@given(datums(), st.data())
def test_split_rejects_broken_shift(datum, data):
    prompt, completion, logprobs, advantages = datum
    arrays = build_datum_arrays(prompt, completion, logprobs, advantages)
    n = len(arrays.target_tokens)
    assume(n >= 2)  # a single position has no shift to break
    # target[i] must equal input[i + 1]; change one of them to any other token.
    i = data.draw(st.integers(0, n - 2))
    targets = list(arrays.target_tokens)
    targets[i] = targets[i] + 1
    with pytest.raises(InputError, match="shift is broken"):
        split_datum_arrays(dataclasses.replace(arrays, target_tokens=targets))


@pytest.mark.parametrize(
    "weights",
    [
        [0.0, 0.0, 0.0, 0.0],  # empty completion
        [0.0, 1.0, 0.0, 1.0],  # a gap
        [1.0, 1.0, 0.0, 0.0],  # weighted prefix, not suffix
        [0.0, 1.0, 1.0, 0.0],  # weighted middle
    ],
)
def test_split_rejects_weights_that_are_not_a_nonempty_suffix(weights):
    arrays = build_datum_arrays([1, 2, 3], [4, 5])
    with pytest.raises(InputError, match="contiguous suffix"):
        split_datum_arrays(dataclasses.replace(arrays, weights=weights))


@pytest.mark.parametrize(
    ("prompt", "completion", "match"),
    [
        ([], [1], "prompt tokens is empty"),
        ([1], [], "completion tokens is empty"),
        ([1, -1], [2], r"prompt tokens\[1\] = -1 is not a token id"),
        ([1], [2, 3, -4], r"completion tokens\[2\] = -4 is not a token id"),
        ([1, 2.0], [3], r"prompt tokens\[1\] = 2.0 is not a token id"),
        ([1], ["3"], r"completion tokens\[0\] = '3' is not a token id"),
        ([True], [3], r"prompt tokens\[0\] = True is not a token id"),
        ([1], [None], r"completion tokens\[0\] = None is not a token id"),
    ],
)
def test_build_rejects_bad_tokens(prompt, completion, match):
    with pytest.raises(InputError, match=match):
        build_datum_arrays(prompt, completion)


@pytest.mark.parametrize(
    ("logprobs", "advantages", "match"),
    [
        ([0.0], None, "completion_logprobs has 1 values but the completion has 2 tokens"),
        ([0.0, 0.0, 0.0], None, "completion_logprobs has 3 values but the completion has 2 tokens"),
        (None, [1.0], "completion_advantages has 1 values but the completion has 2 tokens"),
        ([0.0, 0.0], [], "completion_advantages has 0 values but the completion has 2 tokens"),
    ],
)
def test_build_rejects_misaligned_values(logprobs, advantages, match):
    with pytest.raises(InputError, match=match):
        build_datum_arrays([1, 2], [3, 4], logprobs, advantages)


def test_build_accepts_numpy_int64_tokens():
    prompt = np.array([5, 6, 7], dtype=np.int64)
    completion = [np.int64(8), np.int64(9)]
    arrays = build_datum_arrays(prompt, completion)
    expected = build_datum_arrays([5, 6, 7], [8, 9])
    assert arrays.input_tokens == expected.input_tokens
    assert arrays.target_tokens == expected.target_tokens
    assert arrays.weights == expected.weights
    assert split_datum_arrays(arrays).completion_tokens == [8, 9]


# ---------------------------------------------------------------------------------------------------------
# find_stop / truncate_at_stop
# ---------------------------------------------------------------------------------------------------------


def _reference_find_stop(tokens, stops):
    """Brute force: the shortest prefix that ends with some stop sequence; its length, else None."""
    for end in range(1, len(tokens) + 1):
        prefix = list(tokens[:end])
        for stop in stops:
            if len(stop) <= end and prefix[end - len(stop):] == list(stop):
                return end
    return None


def _contains(tokens, stop):
    k = len(stop)
    return any(list(tokens[i:i + k]) == list(stop) for i in range(len(tokens) - k + 1))


# A tiny alphabet (0..3) makes stop sequences actually occur, overlap and prefix each other; the full
# 0..1000 range is mixed in so the common "no stop here" path is exercised too.
STOP_TOKEN = st.one_of(st.integers(0, 3), TOKEN)
STOP_TOKENS = st.lists(STOP_TOKEN, min_size=1, max_size=30)
STOPS = st.lists(st.lists(STOP_TOKEN, min_size=1, max_size=3), min_size=1, max_size=4)


@PROPERTY
@given(STOP_TOKENS, STOPS)
@example(tokens=[3, 3, 4], stops=[[3, 4]])
@example(tokens=[1, 3, 4, 3, 4], stops=[[3, 4], [4, 3, 4]])
@example(tokens=[3, 3, 3], stops=[[3, 3, 3], [3, 3]])
@example(tokens=[5, 6, 7], stops=[[8]])
def test_truncate_at_stop_properties(tokens, stops):
    kept, reason = truncate_at_stop(tokens, stops)
    assert kept == tokens[: len(kept)]  # a prefix of the input
    assert find_stop(tokens, stops) == _reference_find_stop(tokens, stops)
    if reason == "stop":
        assert any(kept[len(kept) - len(s):] == s for s in stops if len(s) <= len(kept))
        # earliest: no shorter prefix already holds a complete stop sequence
        assert not any(_contains(kept[:-1], s) for s in stops)
    else:
        assert reason == "length"
        assert kept == tokens
        assert not any(_contains(tokens, s) for s in stops)
    # Idempotent: cutting the output again changes nothing.
    assert truncate_at_stop(kept, stops) == (kept, reason)


@pytest.mark.parametrize(
    ("tokens", "stops", "kept", "reason"),
    [
        # The stop sequence itself is kept, nothing after it.
        ([1, 2, 9, 3, 4], [[9]], [1, 2, 9], "stop"),
        ([1, 2, 3], [[9]], [1, 2, 3], "length"),
        # Multi-token stop whose first token repeats: [3, 3, 4] matches [3, 4] at indices 1..2 -> end 3.
        ([3, 3, 4, 5], [[3, 4]], [3, 3, 4], "stop"),
        # An incomplete multi-token stop at the end is not a stop.
        ([1, 3], [[3, 4]], [1, 3], "length"),
        # Earliest completion wins, not the earliest start: [2, 3, 4] starts at 1 but completes at 4;
        # [3] completes at 3.
        ([1, 2, 3, 4], [[2, 3, 4], [3]], [1, 2, 3], "stop"),
        # Order of the stop list does not matter.
        ([1, 2, 3, 4], [[3], [2, 3, 4]], [1, 2, 3], "stop"),
        # Stops that prefix each other: [5] completes before [5, 6].
        ([5, 6, 7], [[5, 6], [5]], [5], "stop"),
        # Stops that suffix each other complete together at the same end.
        ([1, 5, 6, 7], [[6], [5, 6]], [1, 5, 6], "stop"),
        # A stop equal to the whole sequence.
        ([1, 2], [[1, 2]], [1, 2], "stop"),
        # A stop longer than the tokens cannot match.
        ([1, 2], [[1, 2, 3]], [1, 2], "length"),
        # No stops at all.
        ([1, 2], [], [1, 2], "length"),
    ],
)
def test_truncate_at_stop_hand_examples(tokens, stops, kept, reason):
    assert truncate_at_stop(tokens, stops) == (kept, reason)
    assert find_stop(tokens, stops) == (len(kept) if reason == "stop" else None)


@pytest.mark.parametrize("stops", [[[]], [[1], []], [[], [1]]])
def test_empty_stop_sequence_is_rejected(stops):
    with pytest.raises(InputError, match="empty stop sequence"):
        find_stop([1, 2, 3], stops)
    with pytest.raises(InputError, match="empty stop sequence"):
        truncate_at_stop([1, 2, 3], stops)


# ---------------------------------------------------------------------------------------------------------
# pad_batch
# ---------------------------------------------------------------------------------------------------------

BATCH = st.lists(st.lists(TOKEN, min_size=1, max_size=12), min_size=1, max_size=6)
PAD_ID = st.integers(0, 1000)


def _real(batch, row):
    """The (ids, positions) of a row's real tokens, in order."""
    keep = batch.attention_mask[row] == 1
    return batch.input_ids[row][keep].tolist(), batch.position_ids[row][keep].tolist()


def test_pad_batch_hand_example():
    left = pad_batch([[7, 8, 9], [5]], pad_id=0, side="left")
    assert left.input_ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert left.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    right = pad_batch([[7, 8, 9], [5]], pad_id=0, side="right")
    assert right.input_ids.tolist() == [[7, 8, 9], [5, 0, 0]]
    assert right.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert right.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]


@PROPERTY
@given(BATCH, PAD_ID, st.sampled_from(["left", "right"]))
def test_pad_batch_layout(sequences, pad_id, side):
    batch = pad_batch(sequences, pad_id, side=side)
    B, L = len(sequences), max(len(s) for s in sequences)
    for tensor in (batch.input_ids, batch.attention_mask, batch.position_ids):
        assert tensor.shape == (B, L)
        assert tensor.dtype == torch.long
    assert batch.attention_mask.sum(dim=1).tolist() == [len(s) for s in sequences]
    for row, seq in enumerate(sequences):
        n = len(seq)
        real = slice(L - n, L) if side == "left" else slice(0, n)
        pads = slice(0, L - n) if side == "left" else slice(n, L)
        assert batch.input_ids[row, real].tolist() == seq
        assert batch.attention_mask[row, real].tolist() == [1] * n
        assert batch.position_ids[row, real].tolist() == list(range(n))
        assert batch.input_ids[row, pads].tolist() == [pad_id] * (L - n)
        assert batch.attention_mask[row, pads].tolist() == [0] * (L - n)


@PROPERTY
@given(st.lists(TOKEN, min_size=1, max_size=12), BATCH, PAD_ID, st.sampled_from(["left", "right"]))
def test_pad_batch_row_does_not_depend_on_the_rest_of_the_batch(seq, others, pad_id, side):
    alone = _real(pad_batch([seq], pad_id, side=side), 0)
    assert alone == (seq, list(range(len(seq))))
    batch = pad_batch(others + [seq], pad_id, side=side)
    assert _real(batch, len(others)) == alone
    # The other side of padding gives the same real tokens and positions too.
    flipped = pad_batch([seq] + others, pad_id, side="right" if side == "left" else "left")
    assert _real(flipped, 0) == alone


def test_pad_batch_rejects_bad_side_and_empty_batch():
    with pytest.raises(InputError, match="pad side 'middle'"):
        pad_batch([[1]], 0, side="middle")
    with pytest.raises(InputError, match="empty batch"):
        pad_batch([], 0)


# ---------------------------------------------------------------------------------------------------------
# check_token_ids
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([], "prompt is empty"),
        ([0, 1, 10], r"prompt\[2\] = 10 is outside the vocabulary \[0, 10\)"),  # == vocab_size
        ([0, 11], r"prompt\[1\] = 11 is outside"),
        ([-1, 0], r"prompt\[0\] = -1 is outside"),
        ([1, True], r"prompt\[1\] = True is outside"),
        ([1, 2, 3.0], r"prompt\[2\] = 3.0 is outside"),
    ],
)
def test_check_token_ids_rejects(tokens, match):
    with pytest.raises(InputError, match=match):
        check_token_ids(tokens, vocab_size=10, what="prompt")


@PROPERTY
@given(st.lists(st.integers(0, 9), min_size=1, max_size=20))
def test_check_token_ids_accepts_the_vocabulary(tokens):
    assert check_token_ids(tokens, vocab_size=10, what="prompt") is None
    assert check_token_ids(np.array(tokens, dtype=np.int64), vocab_size=10, what="prompt") is None


def test_datum_arrays_is_frozen():
    arrays = build_datum_arrays([1], [2])
    assert isinstance(arrays, DatumArrays)
    with pytest.raises(dataclasses.FrozenInstanceError):
        arrays.weights = [0.0]  # type: ignore[misc]
