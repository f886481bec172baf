"""A sequence's logprobs depend on its own tokens and the weights only: the default numerics by construction.

The trainer's pass (shared prefixes, attention rows of different lengths batched, padded or not) over a model of SmolLM2-135M's
widths (hidden 576, MLP 1536, 9 query and 3 key/value heads, LoRA on every projection) gives every sequence the same
logprobs, bit for bit, whatever else its batch holds, in what order, split how, at any thread count, and from one
process to the next. Each check guards a part of the mechanism (rlrunbook.kernels) and fails without it:

- the composition property fails when a product is the library's GEMM (its kernel follows the row count);
- the thread check fails when a sum is split by the thread count;
- the audit fails when any library reduction or transcendental kernel reaches a logprob;
- the processes check fails when anything depends on the process (addresses, thread pools, allocation).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from rlrunbook.engines import layouts, shared_prefix
from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.row_batches import PADDING_TOLERANCE, ROW_QUERIES, group_rows
from rlrunbook.engines.shared_prefix import SharedPrefixScorer

CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
          "num_key_value_heads": 3, "vocab_size": 4096, "initializer_range": 0.2, "tie_word_embeddings": True}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# 12 sequences of different lengths; 0-2, 3-5 and 6-7 share prompts, as a GRPO group's samples do
PROMPTS = [[11, 400, 7, 93, 1200, 5], [3000, 17, 17, 250], [64, 65, 66]]
SEQUENCES = [PROMPTS[0] + [8, 9, 10, 11][:n] for n in (1, 3, 4)] + [PROMPTS[1] + [99] * n for n in (2, 6, 9)] + [
    PROMPTS[2] + [1, 2, 3, 4, 5, 6, 7][:n] for n in (5, 7)] + [[2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2],
                                                               [4000], [77, 3999], [5] * 14]
HERE = Path(__file__).resolve()


def build_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype).eval()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    for name, param in model.named_parameters():  # B starts at zero: move it so the adapters count
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    return model


def logprobs(scorer: SharedPrefixScorer, sequences: list[list[int]]) -> list[list[float]]:
    """The trainer's teacher-forced logprob of every token after the first, per sequence, in one pass."""
    with torch.no_grad():
        run = scorer.run(sequences)
        rows = [run.flat[i][t] for i, seq in enumerate(sequences) for t in range(len(seq) - 1)]
        targets = [seq[t + 1] for seq in sequences for t in range(len(seq) - 1)]
        values = scorer.score(run.hidden, torch.tensor(rows, dtype=torch.long),
                              torch.tensor(targets, dtype=torch.long)).logprobs.tolist() if rows else []
    out, cursor = [], 0
    for seq in sequences:
        out.append(values[cursor:cursor + len(seq) - 1])
        cursor += len(seq) - 1
    return out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def scorer(request):
    return SharedPrefixScorer(Decoder(build_model(request.param), "invariant"))


@pytest.fixture(scope="module")
def alone(scorer):
    return [logprobs(scorer, [seq])[0] for seq in SEQUENCES]


@settings(max_examples=12)
@given(data=st.data())
def test_any_batch_composition_gives_every_sequence_its_own_logprobs(scorer, alone, data):
    """One batch, shuffled sub-batches, one by one; attention rows cut at any block size and batched without
    padding (the default grouping) or padded (by the element bound alone): the same bits (hypothesis draws the
    order, the cut points, the block and the grouping)."""
    order = data.draw(st.permutations(range(len(SEQUENCES))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(SEQUENCES) - 1), max_size=5)))
    block = data.draw(st.sampled_from([ROW_QUERIES, 4, 3]))
    tolerance = data.draw(st.sampled_from([PADDING_TOLERANCE, math.inf]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shared_prefix, "ROW_QUERIES", block)
        patch.setattr(layouts, "group_rows", functools.partial(group_rows, tolerance=tolerance))
        for start, end in zip([0, *cuts], [*cuts, len(SEQUENCES)], strict=True):
            batch = [SEQUENCES[i] for i in order[start:end]]
            for index, got in zip(order[start:end], logprobs(scorer, batch), strict=True):
                assert got == alone[index], f"sequence {index} in a batch of {len(batch)}"


def test_the_thread_count_and_the_cpu_libraries_change_no_bit(scorer, alone):
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert logprobs(scorer, SEQUENCES) == alone, f"{count} thread(s)"
    finally:
        torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")  # torch 2.13, not relevant
        with torch.backends.mkldnn.flags(enabled=False):
            assert logprobs(scorer, SEQUENCES) == alone, "oneDNN off"


# Ops a pass may run besides the fixed-order kernels: no reduction and no transcendental function, so no library
# kernel can choose an order or round a value by where it sits (PyTorch's vectorised exp and its scalar tail differ).
_ELEMENTWISE_AND_LAYOUT = {
    "add", "sub", "mul", "div", "neg", "rsqrt", "copy", "_to_copy", "clone", "index_select", "embedding", "cat",
    "masked_fill", "gather", "where", "_unsafe_view", "view", "reshape", "expand", "t", "transpose", "permute",
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "contiguous", "detach",
    "empty", "empty_like", "new_empty", "zeros", "new_zeros", "zero", "fill", "full", "lift_fresh", "alias",
    "as_strided", "_reshape_alias", "clamp", "ge", "lt", "le", "gt", "eq", "ne", "bitwise_not", "logical_not",
    "arange", "scalar_tensor", "repeat", "index", "unbind", "stack", "ones", "ones_like", "zeros_like", "max",
    "_local_scalar_dense", "item", "is_nonzero", "nonzero", "min", "sort", "argsort", "index_put", "index_copy",
    "_unique2",  # the distinct key indices of an attention batch (integers)
}


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name.removeprefix("aten::").rstrip("_"))
        return func(*args, **(kwargs or {}))


def test_no_library_reduction_reaches_a_logprob(scorer):
    """Every aten op of the pass is elementwise (correctly rounded) or moves data: the products, norms, attention,
    SiLU and log-sum-exp are the fixed-order kernels, so which BLAS or oneDNN the machine has cannot matter."""
    with _AtenOps() as seen:
        logprobs(scorer, SEQUENCES[:4])
    assert seen.names, "the audit saw no op at all"
    library = sorted(seen.names - _ELEMENTWISE_AND_LAYOUT)
    assert not library, f"library kernels in the pass: {library}"


def _process_logprobs(dtype: str, composition: int) -> list[list[float]]:
    """In this process (started by the test below): the logprobs of SEQUENCES, batched by ``composition``."""
    scorer = SharedPrefixScorer(Decoder(build_model(getattr(torch, dtype)), "invariant"))
    order = list(range(len(SEQUENCES)))
    order = order[composition:] + order[:composition]  # a different first sequence, and so different batches
    size = 1 + composition % 4
    result: list[list[float] | None] = [None] * len(SEQUENCES)
    for start in range(0, len(order), size):
        part = order[start:start + size]
        for index, values in zip(part, logprobs(scorer, [SEQUENCES[i] for i in part]), strict=True):
            result[index] = values
    return result


@pytest.mark.slow
def test_twelve_processes_agree_bit_for_bit(tmp_path):
    """12 processes, alternating 1 and 2 OpenMP threads, each batching the sequences its own way: one answer (bf16)."""
    outputs = []
    procs = []
    for index in range(12):
        out = tmp_path / f"{index}.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(1 + index % 2)}
        procs.append(subprocess.Popen([sys.executable, str(HERE), "bfloat16", str(index), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs.append(out)
        if len(procs) == 2 or index == 11:  # two at a time on a 2-core machine
            for proc in procs:
                _, err = proc.communicate(timeout=600)
                assert proc.returncode == 0, err[-2000:]
            procs = []
    results = [json.loads(path.read_text()) for path in outputs]
    assert results[0] == _process_logprobs("bfloat16", 0)  # and this process agrees too
    assert all(result == results[0] for result in results[1:])


if __name__ == "__main__":  # one process of test_twelve_processes_agree_bit_for_bit
    dtype_name, composition_index, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    Path(path).write_text(json.dumps(_process_logprobs(dtype_name, composition_index)))
