"""A real shape with random weights as a model folder (``save_random_model``): its tokenizer covers the whole
vocabulary, so every id a random model samples decodes to text, and the folder reloads as a qwen2 folder does."""

from __future__ import annotations

import random

import pytest
import torch

from rlrunbook.models import load_causal_lm, load_tokenizer, resolve_model
from rlrunbook.models.shapes import save_random_model
from rlrunbook.models.tiny import SPECIAL_TOKENS, synthetic_tokenizer, tiny_config


@pytest.mark.parametrize("vocab_size", [300, 70_000])  # bytes and a few pairs; all pairs and some triples
def test_the_synthetic_tokenizer_has_exactly_the_vocabulary_and_every_id_decodes(vocab_size):
    tokenizer = synthetic_tokenizer(vocab_size)
    assert len(tokenizer) == vocab_size
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(3)] == list(SPECIAL_TOKENS)
    ids = random.Random(0).sample(range(3, vocab_size), 200) + [vocab_size - 1]
    assert all(tokenizer.decode([i]) != "" for i in ids)
    text = "Describe a rainy afternoon in Zürich: 37 + 48 = ?"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_vocabulary_too_small_for_the_bytes_is_refused():
    with pytest.raises(ValueError, match="vocab_size 100"):
        synthetic_tokenizer(100)


def test_a_saved_random_model_reloads_with_its_tokenizer_covering_its_vocabulary(tmp_path):
    config = tiny_config(2_000, pad_id=99, eos_id=99)
    folder = save_random_model(config, tmp_path / "shape", dtype=torch.float32)
    assert config.eos_token_id == 99  # the caller's config is left as it was
    tokenizer, model = load_tokenizer(resolve_model(str(folder))), load_causal_lm(folder)
    assert len(tokenizer) == model.config.vocab_size == 2_000
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert model.generation_config.repetition_penalty == 1.0  # neutral: sampling is softmax(logits)
    text = "A sentence to encode."
    assert tokenizer.encode(text) == synthetic_tokenizer(2_000).encode(text)  # reloaded as saved
