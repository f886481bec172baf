"""Fixed-order kernels: the default (``invariant``) numerics, where a token's logprob depends on its own tokens and
the weights only.

Every sum that reaches a logprob (products with base weights and LoRA factors, the output layer and its
log-sum-exp, RMSNorm's statistics, attention) is added in an order written in this package's code, in the
working precision (bf16 or fp32 inputs, float32 accumulation), never in an order a library picks for the shape,
the thread count or the CPU; transcendental functions are computed so that an element's value does not depend on
where it sits in its tensor. So the sampler's one-token decode steps and the trainer's full pass agree bit for
bit, and a sequence gets the same logprobs in any batch, at any thread count, from one process to the next.

- :mod:`~rlrunbook.kernels.ops`: the operations with autograd, dispatched by device (what the decoder calls);
- :mod:`~rlrunbook.kernels.cpu`: the C kernels of ``c/`` (orders stated in ``c/fixed_order.h``), compiled on first use
  by :mod:`~rlrunbook.kernels.build`;
- :mod:`~rlrunbook.kernels.gpu`: the same operations in Triton for CUDA (constant tile sizes, no split-K, no
  atomics), with :mod:`~rlrunbook.kernels.gpu_draw` (the seeded draw) and :mod:`~rlrunbook.kernels.gpu_layer` (a
  layer's norm, rotation and gated activation as one kernel each way, run by the trainer and the sampler alike).

docs/numerics.md states the orders, why they are invariant, and what they cost.
"""
