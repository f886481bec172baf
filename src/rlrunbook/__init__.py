"""rlrunbook: RL post-training of LoRA policies behind the Tinker API, checked by a pytest runbook."""

__version__ = "0.1.0"
