"""The memory tracer's shortened models: a config's per-layer lists follow its layer count, whatever the pattern.

The planner traces 1- and 2-layer copies of a model (``with_layers``); a config that states one entry per layer
(``layer_types``: full or sliding attention) must keep exactly that many, or transformers indexes past the list
while building the model. Configs are built here (random weights, nothing downloaded).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from rlrunbook.backend.memory import sampling_transients, skeleton, token_cost, with_layers

FULL, SLIDING = "full_attention", "sliding_attention"
PATTERNS = [[FULL], [SLIDING], [FULL, SLIDING], [SLIDING, FULL], [FULL, SLIDING, FULL], [SLIDING, SLIDING, FULL]]


def _config(kind: str, layer_types: list[str]):
    """A small Qwen2 or Qwen3 config with these layers (sliding ones through ``use_sliding_window``)."""
    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind]
    sliding = SLIDING in layer_types
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    return config_class(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        layer_types=list(layer_types), use_sliding_window=sliding, sliding_window=16 if sliding else None,
                        tie_word_embeddings=False, **extra)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("pattern", PATTERNS, ids="-".join)
@pytest.mark.parametrize("layers", [1, 2, 3, 5])
def test_the_layer_types_follow_the_layer_count_repeating_the_pattern(kind, pattern, layers):
    config = _config(kind, pattern)
    short = with_layers(config, layers)
    assert short.num_hidden_layers == layers
    assert short.layer_types == [pattern[i % len(pattern)] for i in range(layers)]
    assert config.num_hidden_layers == len(pattern) and config.layer_types == pattern  # the original is a copy
    model = skeleton(short, torch.float32, 2)  # transformers builds each layer from its entry: none is missing
    assert len(model.get_base_model().model.layers) == layers


def test_other_per_layer_lists_follow_too():
    config = transformers.SmolLM3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[0],
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    short = with_layers(config, 3)
    assert short.no_rope_layers == [0, 0, 0] and short.layer_types == [FULL] * 3
    assert len(skeleton(short, torch.float32, 2).get_base_model().model.layers) == 3


def test_a_one_layer_model_is_traced():
    """A 1-layer config stating its ``layer_types`` (as a published Qwen2 config does): the training trace builds
    a 2-layer copy, which once kept a 1-entry list and failed with IndexError."""
    config = _config("qwen2", [FULL])
    cost = token_cost(config, torch.float32, 4, "invariant", recompute_layers=False)
    assert cost.per_token > 0
    prefill, decode = sampling_transients(config, torch.float32, "invariant", prefill_tokens=16, rows=2, window=32)
    assert prefill > 0 and decode > 0


def _model_folder(tmp_path, tiny_folder, config) -> str:
    """``tiny``'s tokenizer beside a model of ``config`` with random weights."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    tiny = json.loads((tiny_folder / "config.json").read_text())
    config.vocab_size = tiny["vocab_size"]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tiny[k] for k in
                                                                     ("bos_token_id", "eos_token_id", "pad_token_id"))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def test_a_one_layer_model_gets_a_training_client(tmp_path, tiny_folder, local_service):
    """``create_lora_training_client`` on a 1-layer Qwen2 folder with ``layer_types: ["full_attention"]``: a
    client whose micro-batch budget was traced, not an IndexError."""
    folder = _model_folder(tmp_path, tiny_folder, _config("qwen2", [FULL]))
    training = local_service.create_lora_training_client(folder, rank=4)
    assert training._trainer.micro_batch_tokens is not None and training._trainer.micro_batch_tokens >= 256
