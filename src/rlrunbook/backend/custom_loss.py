"""``forward_backward_custom``: a loss the caller computes from the logprobs of each datum's targets.

The SDK's contract: the loss gets the data and one float32 tensor of target logprobs per datum (shaped like
the datum's ``target_tokens``, on the CPU whatever device trains), returns ``(loss, metrics)``, and its
gradient accumulates into the adapter exactly as ``forward_backward``'s does, until ``optim_step``. The hosted
service needs two passes for it (a forward, the loss on the client, then a backward of the linear surrogate
``sum(-dL/dlp * lp)``); in process autograd reaches the adapter directly, so a batch that fits one micro-batch
takes one forward and one backward. A batch split into micro-batches (a token budget, see
``backend/micro_batches.py``) cannot keep every micro-batch's graph alive, and a custom loss may couple datums
(DPO pairs a chosen and a rejected one): it is scored without gradient first, the loss's gradient with respect
to each logprob is taken on those values, and each micro-batch is then run again with that gradient as the
weights of a linear surrogate, which gives the same parameter gradient.

A loss that raises, or returns something other than a finite scalar tensor, fails the call with the cause;
nothing is added to the gradients then (the caller's training client refuses its later training calls, as
the SDK's does after a failed custom loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from tinker import types

from rlrunbook.backend.datum_items import target_item
from rlrunbook.backend.micro_batches import micro_batches
from rlrunbook.backend.mismatch import split_mismatch_config
from rlrunbook.errors import InputError

CustomLoss = Callable[[list[types.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


class CustomLossError(InputError):
    """The caller's loss raised, or returned something that is not a finite scalar tensor."""


def _shaped(values: torch.Tensor, datum: types.Datum) -> torch.Tensor:
    """``values`` (one per position) on the CPU in the shape of the datum's ``target_tokens``, as the SDK hands
    them: a loss written for Tinker combines them with ``loss_fn_inputs[...].to_torch()``, which are CPU tensors.
    ``.cpu()`` is differentiable, so the gradient still reaches the adapter on the model's device."""
    shape = datum.loss_fn_inputs["target_tokens"].shape
    values = values.cpu()
    return values.reshape(shape) if shape is not None else values


def _call(loss_fn, data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the caller's loss (a callable or a client-side ``LossHandle``) and check what it returns."""
    from tinker.lib.public_interfaces.custom_loss import LossHandle, run_loss_handle

    name = loss_fn.name if isinstance(loss_fn, LossHandle) else getattr(loss_fn, "__name__", type(loss_fn).__name__)
    try:
        result = run_loss_handle(loss_fn, data, logprobs) if isinstance(loss_fn, LossHandle) else loss_fn(data, logprobs)
    except Exception as error:
        raise CustomLossError(f"the custom loss {name!r} raised {type(error).__name__}: {error}") from error
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CustomLossError(f"the custom loss {name!r} returned {type(result).__name__}; it must return "
                              "(loss, metrics): a scalar tensor and a dict of numbers.")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CustomLossError(f"the custom loss {name!r} returned a loss of shape {shape}; it must be a scalar tensor "
                              "(sum or average the per-token terms).")
    value = float(loss.detach())
    if not math.isfinite(value):
        raise CustomLossError(f"the custom loss {name!r} is {value} on this batch; nothing was trained. Check it for "
                              "log(0), division by zero or an overflow.")
    if not loss.requires_grad:
        raise CustomLossError(f"the custom loss {name!r} does not depend on the logprobs it was given (no gradient "
                              "flows from it): compute it from them, without .detach() or .item().")
    if not isinstance(metrics, dict):
        raise CustomLossError(f"the custom loss {name!r} returned metrics of type {type(metrics).__name__}; "
                              "return a dict of numbers.")
    checked = {}
    for key, metric in metrics.items():
        try:
            checked[str(key)] = float(metric.detach()) if isinstance(metric, torch.Tensor) else float(metric)
        except (TypeError, ValueError, RuntimeError):
            raise CustomLossError(f"the custom loss {name!r} returned metric {key!r} = {metric!r}, not a number."
                                  ) from None
    return loss.reshape(()), checked


def forward_backward_custom(trainer, data: Sequence[types.Datum], loss_fn) -> types.ForwardBackwardOutput:
    """Score ``data`` with ``trainer`` (a :class:`~rlrunbook.backend.trainer.Trainer`), compute ``loss_fn`` on
    the targets' logprobs, and add its gradient to the trained weights'. Under torchrun with a sharded model every
    rank calls it (a rank with no data with an empty list) and every rank runs the same number of passes."""
    data = list(data)
    if not data and trainer.collective_passes:  # this rank's share is empty: it joins the others' passes
        trainer.join_passes(0, backward=False)
        trainer.join_passes(0, backward=True)
        trainer.note_gradients(0.0)
        return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[],
                                           metrics={"loss:sum": 0.0, "num_tokens:sum": 0.0, "micro_batches:sum": 0.0})
    if not data:
        raise InputError("empty batch: forward_backward_custom needs at least one Datum.")
    items = [target_item(datum, index, trainer.vocab_size, trainer.max_context) for index, datum in enumerate(data)]
    filters = split_mismatch_config({})[0].filters
    batches = micro_batches([item.input_tokens for item in items], trainer.micro_batch_tokens,
                            trainer.grad_accum_chunks)

    def scored(batch, grad: bool) -> list[torch.Tensor]:
        chunk = items[batch.start:batch.stop]
        with torch.set_grad_enabled(grad):  # the last pass with gradients frees the kept products it reads
            flat = trainer.scoring.score(chunk, filters, with_entropy=False, with_reference=False,
                                         last=grad and batch is batches[-1]).seen_logprobs
        return list(torch.split(flat.float(), [len(item.input_tokens) for item in chunk]))

    # Ranks whose passes are collectives all take the two-phase path, each phase padded to the most passes.
    if len(batches) == 1 and not trainer.collective_passes:  # one forward, autograd from the loss into the weights
        logprobs = [_shaped(lp, d) for lp, d in zip(scored(batches[0], grad=True), data, strict=True)]
        loss, metrics = _call(loss_fn, data, logprobs)
        loss.backward()
    else:  # see the module docstring: the loss's gradient per logprob, then a linear surrogate per micro-batch
        trainer.join_passes(len(batches), backward=False)
        values = [lp for batch in batches for lp in scored(batch, grad=False)]
        leaves = [_shaped(v.detach().clone(), d).requires_grad_(True) for v, d in zip(values, data, strict=True)]
        loss, metrics = _call(loss_fn, data, leaves)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        weights = [torch.zeros_like(v) if g is None else g.reshape(-1).to(v.device) for v, g in zip(values, grads)]
        trainer.join_passes(len(batches), backward=True)
        for batch in batches:
            surrogate = sum((lp * w).sum() for lp, w in zip(scored(batch, grad=True), weights[batch.start:batch.stop]))
            surrogate.backward()
        logprobs = leaves
    trainer.note_gradients(float(loss.detach()))
    metrics = {**metrics, "loss:sum": float(loss.detach()),
               "num_tokens:sum": float(sum(len(item.input_tokens) for item in items)),
               "micro_batches:sum": float(len(batches)),
               "micro_batch_tokens:max": float(max(batch.tokens for batch in batches))}
    outputs = [{"logprobs": types.TensorData.from_torch(lp.detach().float().cpu())} for lp in logprobs]
    return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics)
