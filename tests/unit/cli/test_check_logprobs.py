"""The ``rlrunbook`` command: check-logprobs passes on a correct engine and fails on a broken one."""

from __future__ import annotations

import torch

from rlrunbook import cli, diagnostics


def test_check_logprobs_ok_on_tiny(capsys):
    assert cli.main(["check-logprobs", "--model", "tiny", "--max-tokens", "16", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "max_abs_diff:" in out and out.strip().endswith("ok")
    value = float(out.split("max_abs_diff:")[1].split()[0])
    assert value <= diagnostics.FP32_TOLERANCE
    assert "engine: hf" in out and "dtype: float32" in out and "device: cpu" in out


def test_check_logprobs_uses_the_settings_train_uses(capsys, monkeypatch):
    """TINKER_LOCAL_* choose the engine, dtype and numerics, as for train; flags override them."""
    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", "generate")
    monkeypatch.setenv("TINKER_LOCAL_DTYPE", "bfloat16")
    cli.main(["check-logprobs", "--model", "tiny", "--max-tokens", "8", "--num-samples", "2"])
    out = capsys.readouterr().out
    assert "engine: generate" in out and "dtype: bfloat16" in out
    cli.main(["check-logprobs", "--model", "tiny", "--max-tokens", "8", "--num-samples", "2", "--sampler", "hf",
              "--dtype", "float32", "--numerics", "exact"])
    out = capsys.readouterr().out
    assert "engine: hf" in out and "dtype: float32" in out and "numerics: exact" in out


def test_check_logprobs_fails_on_a_mismatch(capsys, monkeypatch):
    """A trainer that scores the wrong targets (off by one position) must make the command exit non-zero."""
    from rlrunbook.engines.shared_prefix import SharedPrefixScorer

    real = SharedPrefixScorer._head

    def shifted(self, hidden, targets, filters, with_entropy, *kept):
        return real(self, hidden, torch.roll(targets, 1), filters, with_entropy, *kept)

    monkeypatch.setattr(SharedPrefixScorer, "_head", shifted)
    assert cli.main(["check-logprobs", "--model", "tiny", "--max-tokens", "16", "--num-samples", "2"]) == 1
    captured = capsys.readouterr()
    assert "Logprob mismatch" in captured.err
    assert not captured.out.strip().endswith("ok")


def test_unknown_model_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["resolve-model", "no-such-model-anywhere"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model-anywhere" in err and "tiny" in err


def test_resolve_model_prints_a_folder(capsys):
    assert cli.main(["resolve-model", "tiny"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder.endswith(tuple(["tiny-v1", "tiny"])) or "tiny" in folder
