"""The Tinker wire format, both ways, with the SDK's own protobuf classes (``tinker.proto``).

The SDK encodes ``/forward_backward`` requests with ``tinker.proto.request_conv`` and decodes
``ForwardBackwardOutput`` and ``SampleResponse`` results with ``tinker.proto.response_conv``. This module is
the server's half: the inverse of each. Numbers cross as the same bytes (int32 tokens, float32 logprobs and
tensors, float64 metrics), so the wire adds nothing to them; ``tests/unit/service/test_serve.py`` checks each
direction against the SDK's own converter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto

from rlrunbook.errors import InputError

_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_DTYPES = {"float32": (pb.DTYPE_FLOAT32, np.float32), "int64": (pb.DTYPE_INT64, np.int64)}


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``/forward_backward`` request: what ``LocalTrainingClient.forward(_backward)`` takes."""

    model_id: str
    seq_id: int
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """The request the SDK serialized with ``request_conv.forward_backward_request_to_proto``.

    ``InputError`` naming the cause for bytes that are not one, or a datum the local backend cannot read
    (image and audio chunks, NaN in a loss input)."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise InputError(f"the /forward_backward body is not a tinker_public.ForwardBackwardRequest protobuf "
                         f"({error}); send it with the Tinker SDK (TrainingClient.forward_backward).") from None
    if not message.model_id:
        raise InputError("the /forward_backward request names no model_id; send it with the Tinker SDK.")
    data = [_datum(index, datum) for index, datum in enumerate(message.data)]
    return ForwardBackwardCall(model_id=message.model_id, seq_id=message.seq_id, data=data,
                               loss_fn=message.loss_fn, loss_fn_config=_loss_fn_config(message),
                               forward_only=message.forward_only)


def _loss_fn_config(message: pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    """``loss_fn_config_v2`` where the SDK wrote it (numbers and text), else the legacy float map."""
    if message.loss_fn_config_v2:
        return {key: (value.text if value.WhichOneof("value") == "text" else value.number)
                for key, value in message.loss_fn_config_v2.items()}
    return dict(message.loss_fn_config) or None


def _datum(index: int, message: pb.Datum) -> types.Datum:
    chunks = []
    for chunk in message.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InputError(f"datum {index}: a {kind or 'empty'} model_input chunk; rlrunbook serve trains on "
                             "token chunks (EncodedTextChunk) only.")
        tokens = np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32)
        chunks.append(types.EncodedTextChunk(tokens=tokens.tolist()))
    inputs = {}
    for name, tensor in message.loss_fn_inputs.items():
        try:
            value = _tensor_data(tensor)
        except ValueError as error:
            raise InputError(f"datum {index}: loss_fn_inputs[{name!r}]: {error}.") from None
        if value.dtype == "float32" and not np.isfinite(value.to_numpy()).all():
            raise InputError(f"datum {index}: loss_fn_inputs[{name!r}] holds NaN or infinity; send finite values.")
        inputs[name] = value
    return types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs)


def _tensor_data(message: pb.Tensor) -> types.TensorData:
    """The SDK's decoder, except for a dense tensor sent without a shape: the SDK writes none for a
    ``TensorData`` made without one, which it reads as one-dimensional, and so is it read here."""
    if message.shape or message.HasField("sparse_csr"):
        return _tensor_data_from_proto(message)
    for dtype, (proto_dtype, np_dtype) in _DTYPES.items():
        if message.dtype == proto_dtype:
            return types.TensorData(data=np.frombuffer(message.dense, dtype=np_dtype).copy(), dtype=dtype)
    raise ValueError(f"unsupported dtype {message.dtype} (the SDK sends float32 or int64)")


def _records(outputs: list[dict[str, types.TensorData]]) -> Iterator[list[dict[str, types.TensorData]]]:
    """Consecutive datums whose fields share names, dtypes and trailing shapes: one ArrayRecord each."""
    def layout(output: dict[str, types.TensorData]) -> tuple:
        return tuple(sorted((name, value.dtype, tuple(value.to_numpy().shape[1:])) for name, value in output.items()))

    run: list[dict[str, types.TensorData]] = []
    for output in outputs:
        if run and layout(run[0]) != layout(output):
            yield run
            run = []
        run.append(output)
    if run:
        yield run


def _array_record(outputs: list[dict[str, types.TensorData]], record: pb.ArrayRecord) -> None:
    record.num_datums = len(outputs)
    for name, first in outputs[0].items():
        proto_dtype, np_dtype = _DTYPES[first.dtype]
        arrays = [np.ascontiguousarray(output[name].to_numpy(), dtype=np_dtype) for output in outputs]
        offsets = np.cumsum([0] + [array.nbytes for array in arrays], dtype=np.int64)
        field = record.fields[name]
        field.data = b"".join(array.tobytes() for array in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = proto_dtype
        field.trailing_shape.extend(first.to_numpy().shape[1:])


def encode_forward_backward_output(output: types.ForwardBackwardOutput) -> bytes:
    """``output`` as ``tinker_public.ForwardBackwardOutput`` bytes (what ``response_conv`` decodes)."""
    message = pb.ForwardBackwardOutput()
    message.loss_fn_output_type = output.loss_fn_output_type
    for run in _records(list(output.loss_fn_outputs)):
        _array_record(run, message.loss_fn_outputs.add())
    for key, value in output.metrics.items():
        message.metrics[key] = float(value)
    return message.SerializeToString()


def encode_sample_response(response: types.SampleResponse) -> bytes:
    """``response`` as ``tinker_public.SampleResponse`` bytes; prompt logprobs without a value are NaN, as the
    SDK's decoder reads them."""
    message = pb.SampleResponse()
    for sequence in response.sequences:
        item = message.sequences.add()
        item.stop_reason = _STOP_REASONS[sequence.stop_reason]
        item.tokens = np.asarray(sequence.tokens, dtype=np.int32).tobytes()
        if sequence.logprobs is not None:
            item.logprobs = np.asarray(sequence.logprobs, dtype=np.float32).tobytes()
    prompt = response.prompt_logprobs
    if prompt is not None:
        values = [math.nan if value is None else value for value in prompt]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return message.SerializeToString()
