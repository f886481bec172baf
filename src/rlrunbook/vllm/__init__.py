"""Sampling through a vLLM server: its settings (``settings``), the HTTP client (``client``), a server this
process starts and stops (``server``), the checks that the served model is the trained one (``checks``), the
LoRA adapters loaded into it (``adapters``) and the sampling engine over them (``engine``). The local backend
binds them to its clients in :mod:`rlrunbook.backend.vllm_sampling`."""
