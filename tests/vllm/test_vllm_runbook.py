"""Runbook §5 with the vLLM sampler: the mini debate RS→GRPO experiment passes the rubric, and
``check-logprobs`` names its engine."""

from __future__ import annotations

import pytest

from rlrunbook import cli
from rlrunbook.run import check_run, format_results, rubric_passed

pytestmark = pytest.mark.vllm


def test_mini_debate_rs_grpo_with_vllm_sampler(tmp_path, capsys, monkeypatch, vllm_url):
    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", "vllm")
    monkeypatch.setenv("TINKER_LOCAL_VLLM_URL", vllm_url)
    code = cli.main(
        [
            "train",
            "--no-proxy",
            "--log-root",
            str(tmp_path),
            "--mode",
            "debate",
            "--env",
            "summary",
            "--dataset",
            "cnn_dailymail",
            "--reward-fn",
            "compression",
            "-n",
            "32",
            "--num-groups",
            "4",
            "-s",
            "3",
            "--max-tokens",
            "32",
            "--mock-judge",
            "--debate-train",
            "rs_grpo",
            "--debate-grpo-reward",
            "task",
            "--model",
            "tiny-vllm",
            "--name",
            "mini_debate_rs_grpo_vllm",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"[vllm] sampling with {vllm_url}" in out
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    results = check_run(run)
    assert rubric_passed(results), format_results(results)


@pytest.mark.parametrize("sampler", ["vllm", "hf"])
def test_check_logprobs_names_its_engine(capsys, monkeypatch, vllm_url, sampler):
    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", sampler)  # honoured without --sampler
    monkeypatch.setenv("TINKER_LOCAL_VLLM_URL", vllm_url)
    code = cli.main(["check-logprobs", "--model", "tiny-vllm", "--num-samples", "4", "--temperature", "0.7"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"engine: {sampler}\n" in out and "\nok" in out
