"""``python -m rlrunbook.cookbook``: the supported cookbook range, and what the runner binds (and unbinds).

tinker-cookbook is a test dependency here (scripts/setup.sh installs the ``cookbook`` extra): a
missing cookbook fails these tests with the install command rather than skipping them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
from sdk_origin import assert_is_the_sdk

from rlrunbook.cookbook import SUPPORTED_RANGE, check_cookbook_version, cookbook_version
from rlrunbook.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def cookbook_installed():
    try:
        return cookbook_version()
    except ConfigError as error:
        pytest.fail(str(error), pytrace=False)


def test_supported_version_range_is_pinned():
    """Validated against tinker-cookbook 0.6.1 (on tinker 0.38.0): bump this test only after re-running the e2e recipes."""
    assert SUPPORTED_RANGE == ">=0.6,<0.7"
    assert check_cookbook_version() == cookbook_version()
    for version in ("0.6.0", "0.6.1", "0.6.9"):
        assert check_cookbook_version(version) == version
    for version in ("0.5.8", "0.7.0", "1.0.0"):
        with pytest.raises(ConfigError, match=re.escape(SUPPORTED_RANGE)):
            check_cookbook_version(version)


def test_install_scripts_pin_the_same_range():
    """setup.sh installs tinker-cookbook{SUPPORTED_RANGE} (--no-deps, see the extra's comment) with the extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "cookbook" in extras and not any(r.startswith("tinker-cookbook") for r in extras["cookbook"])
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"tinker-cookbook{SUPPORTED_RANGE}" in setup
    assert re.search(r'RLRUNBOOK_EXTRAS:-test,cookbook', setup)


@pytest.fixture
def bindings():
    from rlrunbook.cookbook.bindings import Bindings

    made = Bindings()
    yield made
    made.undo()


def test_local_clients_are_bound_in_this_process_only_and_undone(bindings):
    import tinker
    from tinker.lib.public_interfaces.service_client import ServiceClient as SdkServiceClient

    from rlrunbook.backend import LocalRestClient, SdkLocalServiceClient
    from rlrunbook.cookbook.bindings import bind_local_clients

    bind_local_clients(bindings)
    assert tinker.ServiceClient is SdkLocalServiceClient and tinker.RestClient is LocalRestClient
    assert_is_the_sdk(tinker)
    assert tinker.types.SamplingParams.__module__.split(".")[0] == "tinker"
    bindings.undo()
    assert tinker.ServiceClient is SdkServiceClient


def test_model_table_answers_unknown_models_only(bindings):
    from tinker_cookbook import model_info

    from rlrunbook.cookbook.bindings import answer_model_table

    answer_model_table(bindings, None)
    with pytest.raises(ConfigError, match="--renderer qwen3_instruct"):
        model_info.get_recommended_renderer_name("tiny")
    bindings.undo()
    answer_model_table(bindings, "qwen3_instruct")
    assert model_info.get_recommended_renderer_name("tiny") == "qwen3_instruct"
    assert model_info.get_recommended_renderer_name("Qwen/Qwen3-8B") == "qwen3", "known models keep their entry"


def test_builtin_tokenizers_and_chatml_renderer(bindings):
    from tinker_cookbook import renderers, tokenizer_utils

    from rlrunbook.cookbook.bindings import CHATML_RENDERER, register_builtin_tokenizers
    from rlrunbook.models import load_tokenizer, resolve_model

    register_builtin_tokenizers(bindings)
    tokenizer = tokenizer_utils.get_tokenizer("tiny")
    ours = load_tokenizer(resolve_model("tiny"))
    messages = [{"role": "user", "content": "What is 4 + 5?"}]
    rendered = renderers.get_renderer(CHATML_RENDERER, tokenizer).build_generation_prompt(messages).to_ints()
    chat_template = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert rendered == list(chat_template), "qwen3_instruct renders tiny's own ChatML template token for token"
    bindings.undo()
    assert not tokenizer_utils.is_tokenizer_registered("tiny")


def test_hub_datasets_served_from_local_files(bindings, tmp_path):
    import datasets

    from rlrunbook.cookbook.bindings import serve_datasets_locally

    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)]
    file = tmp_path / "gsm8k.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    serve_datasets_locally(bindings, {"openai/gsm8k": file})
    whole = datasets.load_dataset("openai/gsm8k", "main")
    assert isinstance(whole, datasets.DatasetDict)
    assert whole["train"]["question"] == whole["test"]["question"] == [r["question"] for r in rows]
    assert datasets.load_dataset("openai/gsm8k", "main", split="test[:2]")["answer"] == ["#### 0", "#### 1"]
    with pytest.raises(ConfigError, match="no such file"):
        serve_datasets_locally(bindings, {"x/y": tmp_path / "missing.jsonl"})


def test_runner_options():
    from rlrunbook.cookbook.runner import parse_args

    args = parse_args(["--renderer", "qwen3_instruct", "--hf-dataset", "openai/gsm8k=/d/g.jsonl",
                       "tinker_cookbook.recipes.rl_loop", "model_name=tiny", "--flag"])
    assert args.recipe == "tinker_cookbook.recipes.rl_loop"
    assert args.recipe_args == ["model_name=tiny", "--flag"]
    assert args.hf_dataset == [("openai/gsm8k", Path("/d/g.jsonl"))]
    with pytest.raises(SystemExit):
        parse_args(["--hf-dataset", "no-equals-sign", "x"])


def test_streamed_hub_datasets_are_iterable_and_keep_row_slices(bindings, tmp_path):
    """A recipe that streams (off_policy_reasoning: load_dataset(..., streaming=True).shuffle(buffer_size=...))
    gets an IterableDataset of the file's rows, in order; a row slice of the split is kept as skip/take."""
    import datasets

    from rlrunbook.cookbook.bindings import serve_datasets_locally

    file = tmp_path / "ot3.jsonl"
    file.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(6)))
    serve_datasets_locally(bindings, {"open-thoughts/OpenThoughts3-1.2M": file})
    stream = datasets.load_dataset("open-thoughts/OpenThoughts3-1.2M", split="train", streaming=True)
    assert isinstance(stream, datasets.IterableDataset)
    values = [row["conversations"][0]["value"] for row in stream]
    assert values == [f"q{i}" for i in range(6)]
    shuffled = [row["conversations"][0]["value"] for row in stream.shuffle(buffer_size=6, seed=0)]
    assert sorted(shuffled) == values
    window = datasets.load_dataset("open-thoughts/OpenThoughts3-1.2M", split="train[2:5]", streaming=True)
    assert [row["conversations"][0]["value"] for row in window] == ["q2", "q3", "q4"]
    every = datasets.load_dataset("open-thoughts/OpenThoughts3-1.2M", streaming=True)
    assert isinstance(every["test"], datasets.IterableDataset)
    with pytest.raises(ConfigError, match="cannot be streamed"):
        datasets.load_dataset("open-thoughts/OpenThoughts3-1.2M", split="train[:10%]", streaming=True)


def test_hub_models_stand_in_for_sampling_training_and_tokenizer(bindings, tmp_path, monkeypatch):
    """--hf-model NAME=tiny-thinking: the backend loads tiny-thinking for NAME (its vocabulary, 721 tokens),
    the cookbook's get_tokenizer(NAME) is its tokenizer, and the client keeps the name it asked for."""
    from tinker_cookbook import tokenizer_utils

    from rlrunbook.backend import LocalServiceClient, LocalSettings
    from rlrunbook.cookbook.bindings import stand_in_models

    monkeypatch.delenv("TINKER_LOCAL_MODEL_STAND_INS", raising=False)
    stand_in_models(bindings, {"Qwen/Qwen3.5-9B": "tiny-thinking"})
    assert tokenizer_utils.get_tokenizer("Qwen/Qwen3.5-9B").encode("</think>", add_special_tokens=False) == [720]
    settings = LocalSettings.from_env()
    assert settings.model_for("Qwen/Qwen3.5-9B") == "tiny-thinking" and settings.model_for("tiny") == "tiny"
    service = LocalServiceClient(LocalSettings(device="cpu", storage_dir=tmp_path,
                                               model_stand_ins=settings.model_stand_ins))
    try:
        sampler = service.create_sampling_client(base_model="Qwen/Qwen3.5-9B")
        assert sampler.get_base_model() == "Qwen/Qwen3.5-9B"
        assert sampler.get_tokenizer().vocab_size + 2 == len(sampler.get_tokenizer()) == 721
    finally:
        service.close()
    bindings.undo()
    assert not tokenizer_utils.is_tokenizer_registered("Qwen/Qwen3.5-9B")
    import os

    assert "TINKER_LOCAL_MODEL_STAND_INS" not in os.environ


def test_a_stand_in_whose_tokenizer_the_recipes_renderer_rejects_is_refused_at_start(bindings):
    from rlrunbook.cookbook.bindings import stand_in_models

    with pytest.raises(ConfigError) as info:  # tiny has no single-token </think>, which qwen3_5 asserts
        stand_in_models(bindings, {"Qwen/Qwen3.5-9B": "tiny"})
    message = str(info.value)
    assert "Qwen/Qwen3.5-9B=tiny" in message and "'qwen3_5'" in message and "think_suffix_token" in message
    assert "--hf-model Qwen/Qwen3.5-9B=tiny-thinking" in message


def test_stand_in_settings_parse_and_refuse_malformed_entries():
    from rlrunbook.backend import LocalSettings

    settings = LocalSettings.from_env({"TINKER_LOCAL_MODEL_STAND_INS": "a/b=tiny, c/d = /models/x ,"})
    assert settings.model_stand_ins == (("a/b", "tiny"), ("c/d", "/models/x"))
    with pytest.raises(ConfigError, match="not NAME=MODEL"):
        LocalSettings.from_env({"TINKER_LOCAL_MODEL_STAND_INS": "a/b"})


def test_image_and_audio_recipes_are_refused_before_any_model_loads(monkeypatch):
    from rlrunbook.cookbook.runner import check_recipe

    monkeypatch.delenv("TINKER_BACKEND", raising=False)
    with pytest.raises(ConfigError, match="vision-language model on images"):
        check_recipe("tinker_cookbook.recipes.vlm_classifier.train")
    with pytest.raises(ConfigError, match="speech model on audio"):
        check_recipe("tinker_cookbook.recipes.audio.asr.train")
    check_recipe("tinker_cookbook.recipes.math_rl.train")  # served
