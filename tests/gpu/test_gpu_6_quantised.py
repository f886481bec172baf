"""4-bit base weights (bitsandbytes NF4) on the GPU: routed to the engines that run them, trained by the padded path.

What ``backend.load_in_4bit`` (the gpu-8b-lora-4bit preset) does on CUDA, on the models under test: the in-process
engine refuses the model naming the samplers that run it; with ``sampler=generate`` a LoRA step samples, scores
through transformers' forward over padded datums, moves the adapter, and leaves the packed base weights as they
were. 4-bit is an optional part of the tier (rlrunbook.testing.gpu.OPTIONAL_PARTS): where bitsandbytes is not
installed (the staged GPU image has none) these tests skip as "not proven", also under RLRUNBOOK_REQUIRE_GPU=1, and
the report counts them so.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import DEVICE, chat_prompts
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.chunk_scores import PaddedScoring
from rlrunbook.engines.decoder import Decoder, quantised_weights
from rlrunbook.errors import ConfigError
from rlrunbook.testing.gpu import missing_module
from rlrunbook.testing.gpu_plugin import skip_optional_part
from rlrunbook.tokens import build_datum_arrays

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _bitsandbytes():
    skip_optional_part("bitsandbytes", missing_module("bitsandbytes", "pip install bitsandbytes"))


def test_the_in_process_engine_refuses_a_4bit_model(model_name):
    from rlrunbook.models import load_causal_lm, resolve_model

    model = load_causal_lm(resolve_model(model_name), dtype=torch.bfloat16, device=DEVICE, load_in_4bit=True)
    assert "Linear4bit" in quantised_weights(model)
    with pytest.raises(ConfigError, match="TINKER_LOCAL_SAMPLER=generate"):
        Decoder(model)
    del model
    torch.cuda.empty_cache()


def test_a_4bit_lora_step_with_generate_trains_through_the_padded_path(model_name, tmp_path, record_property):
    settings = LocalSettings(device=DEVICE, dtype=torch.bfloat16, load_in_4bit=True, sampler="generate",
                             storage_dir=tmp_path / "tinker")
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client(model_name, rank=8, seed=0)
        assert isinstance(training._trainer.scoring, PaddedScoring)
        prompt = chat_prompts(training.get_tokenizer(), 2)[1]
        sampler = training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=0)
        sequences = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
        model = training._host.model
        packed = {n: p.detach().clone() for n, p in model.named_parameters() if not p.dtype.is_floating_point}
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
        assert packed and lora
        data = []
        for sequence, advantage in zip(sequences, [1.0, -1.0, 0.5, -0.5], strict=True):
            arrays = build_datum_arrays(prompt, list(sequence.tokens), list(sequence.logprobs),
                                        [advantage] * len(sequence.tokens))
            data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                    loss_fn_inputs={"target_tokens": arrays.target_tokens,
                                                    "logprobs": arrays.logprobs, "advantages": arrays.advantages}))
        out = training.forward_backward(data, "importance_sampling").result()
        loss = float(out.metrics["loss:sum"])
        assert math.isfinite(loss)
        record_property("mismatch_abs_logprob_diff", out.metrics.get("mismatch/abs_logprob_diff:mean"))
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        after = dict(model.named_parameters())
        assert all(torch.equal(after[n], p) for n, p in packed.items()), "the 4-bit base weights never change"
        assert any(not torch.equal(after[n], p) for n, p in lora.items()), "the adapter moved"
    torch.cuda.empty_cache()
