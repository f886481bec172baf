"""A model's architecture (its transformers config) without its weights: what a memory plan needs.

The config comes from the model's folder where it is at hand (a built-in, a local folder, the Hugging Face
cache); for the models the shipped presets name, the published configuration values are kept here, so a plan
for a model not yet downloaded (``show-config --config-file h100-rlvr`` on a fresh machine) still has its shape.
"""

from __future__ import annotations

from pathlib import Path

from rlrunbook.errors import ConfigError

# Architecture values of published checkpoints (their config.json), for planning before a download.
PUBLISHED_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2.5-Math-1.5B": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-06, "hidden_act": "silu",
    },
    "Qwen/Qwen3-4B": {
        "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-06, "hidden_act": "silu",
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
}


def model_shape(name: str):
    """``(config, where it came from)`` for the model called ``name``, without loading its weights.

    A built-in is built if needed (as ``train`` would); a folder's or the Hugging Face cache's ``config.json``
    is read; otherwise the published values above. ``ConfigError`` when none of these knows the model.
    """
    from transformers import AutoConfig, PretrainedConfig

    from rlrunbook.models.registry import BUILTIN_MODELS, resolve_model

    if name in BUILTIN_MODELS:
        folder = resolve_model(name)
        return AutoConfig.from_pretrained(folder), f"built-in {name}"
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder), f"{folder / 'config.json'}"
    cached = _hub_cache_config(name)
    if cached is not None:
        return AutoConfig.from_pretrained(cached.parent), f"the Hugging Face cache ({cached})"
    if name in PUBLISHED_CONFIGS:
        values = dict(PUBLISHED_CONFIGS[name])
        config_class = type(AutoConfig.for_model(values["model_type"]))
        config: PretrainedConfig = config_class(**{k: v for k, v in values.items() if k != "model_type"})
        return config, f"the published configuration of {name} (not downloaded)"
    raise ConfigError(f"no configuration for model {name!r} here: it is not a built-in, not a folder with "
                      "config.json and not in the Hugging Face cache. Download it (`hf download "
                      f"{name} config.json`) or pass its folder, so its memory can be planned.")


def _hub_cache_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local Hugging Face cache, if it is there (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an invalid repo id is simply not in the cache
        return None
    return Path(found) if isinstance(found, str) else None


def save_random_model(config, out_dir: Path, *, dtype=None, device: str = "cpu", seed: int = 0) -> Path:
    """Write a model folder of ``config``'s architecture with random weights and a tokenizer covering its vocabulary.

    For measuring speed at a real shape without a download: the weights are ``from_config``'s initialisation
    (``seed``), made on ``device`` in ``dtype``; the tokenizer is :func:`rlrunbook.models.tiny.synthetic_tokenizer`
    of ``config.vocab_size`` tokens (every sampled id decodes to text), whose special ids the config and a neutral
    generation config take. ``config`` is not modified. Returns ``out_dir``.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from rlrunbook.models.tiny import neutral_generation_config, synthetic_tokenizer

    tokenizer = synthetic_tokenizer(config.vocab_size)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = copy.deepcopy(config)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = pad_id, eos_id, pad_id
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.generation_config = neutral_generation_config(pad_id, eos_id, pad_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir
