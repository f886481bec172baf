"""The built-in ``tiny`` model: a 2-layer Qwen2 with its own BPE tokenizer, built offline in seconds.

It exists so that tests and examples exercise the real transformers code paths (Qwen2 attention
with grouped KV heads, RoPE, left padding, a ChatML template) without any download. Its weights
are random; it is not meant to say anything sensible.

Choices that are not the transformers defaults, and why:

* ``initializer_range=0.2``: with the default 0.02 the next-token distributions are nearly
  uniform, which makes logprob-parity and learning tests weak (docs/models.md).
* ``tie_word_embeddings=False``: with tied weights a random model mostly predicts the token it
  just read (the residual stream still holds that token's embedding); untied, the next-token
  distribution is unrelated to the input token. It also makes the pair of built-ins cover both
  cases, since SmolLM2 ties its embeddings.
* The tokenizer is trained with exactly the normalizer and pre-tokenizer that transformers'
  ``Qwen2Tokenizer`` rebuilds on reload (NFC; Qwen2 split regex; ByteLevel without regex), so the
  saved folder encodes text the same way as the tokenizer that was trained.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Bump whenever anything below changes what gets written: the registry caches by this version.
TINY_VERSION = 1

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TARGET_VOCAB_SIZE = 1024

# Copied from transformers/models/qwen2/tokenization_qwen2.py (PRETOKENIZE_REGEX); must stay equal.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as in Qwen2 minus the default system prompt and tool calling.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Zoë", "José", "Renée", "Søren"]
_NOUNS = ["cat", "dog", "river", "model", "token", "garden", "teacher", "number", "window", "city", "book"]
_ADJECTIVES = ["quick", "lazy", "bright", "small", "old", "careful", "green", "quiet", "strange", "naïve"]
_VERBS = ["sees", "likes", "reads", "counts", "finds", "builds", "follows", "answers", "writes", "visits"]
_PLACES = ["in the park", "near the river", "at school", "in Zürich", "at the café", "on Monday", "today"]
_QUESTIONS = ["Why is the sky blue?", "Can you help me?", "What does this word mean?", "Where is the book?"]
_UNICODE_LINES = [
    "Crème brûlée, déjà vu, façade, naïve, coöperate.",
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир.",
    "日本語のテキスト。中文文本。한국어 문장.",
    "Emoji: 🙂 🚀 ✓ → ≤ ≥ ± × ÷ ∑ π ∞",
    "Tabs\tand  double  spaces,\r\nWindows newlines and trailing spaces   ",
    "Code: def f(x): return x ** 2  # squares; {'a': [1, 2, 3]}",
]


def tiny_corpus() -> list[str]:
    """Return the fixed tokenizer-training corpus: English sentences, arithmetic Q&A and chat turns.

    Generated from a fixed-seed ``random.Random`` so that the tokenizer (and with it every
    ``tiny`` model of any weight seed) is the same on every machine.
    """
    rng = random.Random(20240917)
    lines: list[str] = []
    for _ in range(1500):
        a, b = rng.choice(_ADJECTIVES), rng.choice(_NOUNS)
        lines.append(
            f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {a} {b} {rng.choice(_PLACES)}."
            if rng.random() < 0.7
            else f"The {b} is {a}, isn't it? I'd say it's {rng.choice(_ADJECTIVES)}!"
        )
    for _ in range(1500):
        x, y, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        answer = x + y if op == "+" else x - y if op == "-" else x * y
        question, reply = f"What is {x} {op} {y}?", f"The answer is {answer}."
        lines.append(f"{question}\n{reply}")
        # Chat turns as the template renders them, minus the special tokens, which are never split.
        lines.append(f"system\nYou are a helpful assistant.\nuser\n{question}\nassistant\n{reply}\n")
    for _ in range(200):
        lines.append(f"user\n{rng.choice(_QUESTIONS)}\nassistant\nI think so, {rng.choice(_NAMES)}.\n")
    lines.extend(_UNICODE_LINES * 20)
    return lines


def train_tiny_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer of ``tiny`` (about 1,024 tokens) on :func:`tiny_corpus`.

    Special tokens take ids 0-2 and all 256 byte symbols are in the vocabulary, so any string
    encodes without an unknown token.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus(), trainer=trainer)
    return tokenizer


def _to_transformers_tokenizer(tokenizer: Tokenizer):
    """Wrap the trained tokenizer as the ``Qwen2Tokenizer`` that ``AutoTokenizer`` will rebuild."""
    from transformers import Qwen2Tokenizer

    model_json = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    return Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        # Constructor arguments are what save_pretrained records; setting attributes later is lost.
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE ``Qwen2Tokenizer`` of exactly ``vocab_size`` tokens, for a real shape with random weights.

    Ids 0-2 are ``tiny``'s special tokens (ChatML, ``<|im_end|>`` as EOS), then the 256 byte symbols, then synthetic
    merges: every pair of byte symbols, then byte triples, in a fixed order, until the vocabulary is full. So every
    id a random model of that vocabulary samples decodes to text (2-3 bytes), and any string encodes. Normalizer
    and pre-tokenizer are Qwen2's (as ``tiny``'s), so a qwen2 folder reloads it unchanged. Refuses a vocabulary
    too small for the specials and the bytes, or larger than triples reach (~16.8M).
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if not len(SPECIAL_TOKENS) + len(alphabet) <= vocab_size <= len(SPECIAL_TOKENS) + len(alphabet) + 256**2 + 256**3:
        raise ValueError(f"vocab_size {vocab_size} outside what specials, bytes, pairs and triples make")
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    merges = []
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return _to_transformers_tokenizer(tokenizer)


def tiny_config(vocab_size: int, pad_id: int, eos_id: int):
    """Return the ``Qwen2Config`` of ``tiny`` (hidden 64, 2 layers, 4 query / 2 KV heads)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        # As in Qwen2.5: no BOS is prepended by the tokenizer; <|endoftext|> stands in for generate().
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )


def tiny_vllm_config(vocab_size: int, pad_id: int, eos_id: int):
    """The ``LlamaConfig`` of ``tiny-vllm``: ``tiny``'s sizes with 2 query / 1 KV heads of 32 dimensions.

    Why not ``tiny`` itself: vLLM 0.32's CPU attention supports head sizes 32, 64, 80, ... and refuses
    ``tiny``'s 16 at the first request; and its Qwen2 implementation serves no LoRA on ``lm_head``,
    which the training loop adapts by default, while its Llama implementation does.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )


def neutral_generation_config(bos_id: int | None, eos_id: int, pad_id: int):
    """Return a ``GenerationConfig`` whose sampling is exactly ``softmax(logits)``.

    Every logits processor field is written at its neutral value, because fields a caller leaves
    unset are filled from the model's generation config (docs/numerics.md).
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        length_penalty=1.0,
    )


def build_tiny(out_dir: Path, seed: int = 0, config_fn=tiny_config, added_tokens: tuple[str, ...] = ()) -> Path:
    """Build the ``tiny`` Qwen2 model, tokenizer and generation config into ``out_dir``; return it.

    Deterministic: the same ``seed`` gives byte-identical files. The tokenizer does not depend
    on ``seed``; only the weights do. Takes about a second on CPU. ``config_fn`` gives another
    architecture with the same tokenizer (:func:`build_tiny_vllm`); ``added_tokens`` become single tokens after
    the trained vocabulary (:func:`build_tiny_thinking`).
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer = _to_transformers_tokenizer(train_tiny_tokenizer())
    if added_tokens:
        hf_tokenizer.add_tokens(list(added_tokens))
    pad_id, eos_id = hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id
    config = config_fn(len(hf_tokenizer), pad_id=pad_id, eos_id=eos_id)
    # fork_rng: seeding here must not change the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = neutral_generation_config(pad_id, eos_id, pad_id)
    model.save_pretrained(out_dir)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, readable by old tools too.
    hf_tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir


# Qwen3's reasoning delimiters: single (non-special) tokens there, which the cookbook's Qwen3/Qwen3.5 renderers
# require of the tokenizer they are given.
THINK_TOKENS = ("<think>", "</think>")


def build_tiny_thinking(out_dir: Path, seed: int = 0) -> Path:
    """Build ``tiny-thinking``: ``tiny`` whose tokenizer also has ``<think>`` and ``</think>`` as single tokens
    (ids 719 and 720, two more embedding rows), to stand in for a Qwen3-family model a recipe names."""
    return build_tiny(out_dir, seed=seed, added_tokens=THINK_TOKENS)


def build_tiny_vllm(out_dir: Path, seed: int = 0) -> Path:
    """Build ``tiny-vllm`` (:func:`tiny_vllm_config`; ``tiny``'s tokenizer): what the vLLM sampler's tests serve."""
    return build_tiny(out_dir, seed=seed, config_fn=tiny_vllm_config)
