"""A user's mistake is one paragraph naming the cause and the fix, exit 2, before any model loads and
before a run directory exists (issue 14, point 3). One test per case.

Every ``train`` case runs ``cli.main`` in process with model loading patched to fail loudly, so a
refusal that came after a model load would show as that failure, and checks that the log root holds
no run directory afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from rlrunbook import cli

TRAIN = ["train", "--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "8", "--num-groups", "2", "-s", "1"]


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading any model fails the test: every refusal here must come first."""
    from rlrunbook.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input error was reported")

    monkeypatch.setattr(loading, "load_causal_lm", refuse)
    monkeypatch.setattr(loading, "load_tokenizer", refuse)


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI; assert exit 2 with one paragraph on stderr (no traceback); return the message."""
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and "\n\n" not in err, err
    return err


def no_run_dirs(root) -> bool:
    return not root.exists() or not any(p.is_dir() and "_grpo_" in p.name for p in root.rglob("*"))


# --- where runs go ------------------------------------------------------------------------------------------

def test_log_root_that_is_a_file(tmp_path, capsys, no_model_load):
    (tmp_path / "afile").write_text("x")
    err = refused(capsys, [*TRAIN, "--log-root", str(tmp_path / "afile")])
    assert "is a file, not a directory" in err and "--log-root" in err


def test_log_root_under_a_file(tmp_path, capsys, no_model_load):
    (tmp_path / "afile").write_text("x")
    err = refused(capsys, [*TRAIN, "--log-root", str(tmp_path / "afile" / "logs")])
    assert f"lies under {tmp_path / 'afile'}, which is a file" in err
    assert no_run_dirs(tmp_path)


def _make_unwritable(folder) -> None:
    """chmod for a normal user; root ignores modes, so there the immutable attribute (chattr +i)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)],
                                                         capture_output=True, check=False).returncode != 0:
        pytest.skip("running as root without chattr +i: no way to make a folder unwritable here")
    try:
        (folder / "probe").mkdir()
    except OSError:
        return
    (folder / "probe").rmdir()
    pytest.skip("this file system lets the process write into the folder anyway")


def _make_writable(folder) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
    folder.chmod(0o755)


def test_log_root_read_only(tmp_path, capsys, no_model_load):
    root = tmp_path / "ro"
    root.mkdir()
    _make_unwritable(root)
    try:
        err = refused(capsys, [*TRAIN, "--log-root", str(root)])
        assert "is not writable" in err and "--log-root" in err
        assert list(root.iterdir()) == []  # not even the probe is left
    finally:
        _make_writable(root)


def test_name_too_long_for_the_file_system(tmp_path, capsys, no_model_load):
    err = refused(capsys, [*TRAIN, "--log-root", str(tmp_path / "logs"), "--name", "x" * 300])
    assert "--name of 300 characters" in err and "limit of 255" in err and "at most 226 bytes" in err
    assert no_run_dirs(tmp_path)


# --- config files -------------------------------------------------------------------------------------------

def test_config_file_that_is_binary(tmp_path, capsys, no_model_load):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    err = refused(capsys, [*TRAIN, "--config-file", str(path), "--log-root", str(tmp_path)])
    assert "binary (a NUL byte at offset 8)" in err and "Pass the YAML file" in err


def test_config_file_that_is_not_utf8(tmp_path, capsys, no_model_load):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    err = refused(capsys, [*TRAIN, "--config-file", str(path), "--log-root", str(tmp_path)])
    assert "not UTF-8 text (byte 0xe9 at offset 9)" in err and "Save the file as UTF-8" in err


def test_a_key_given_twice_in_a_yaml_file(tmp_path, capsys, no_model_load):
    path = tmp_path / "twice.yaml"
    path.write_text("steps: 2\nseed: 1\nsteps: 3\n")
    err = refused(capsys, [*TRAIN, "--config-file", str(path), "--log-root", str(tmp_path)])
    assert "key 'steps' is given twice (lines 1 and 3)" in err and "Keep one of them" in err
    assert no_run_dirs(tmp_path)


def test_a_bad_override_is_refused_although_a_flag_replaces_it(tmp_path, capsys, no_model_load):
    err = refused(capsys, [*TRAIN, "temperature=abc", "--temperature", "0.7", "--log-root", str(tmp_path)])
    assert "temperature: Input should be a valid number" in err and "from override" in err


def test_infinite_temperature(tmp_path, capsys, no_model_load):
    err = refused(capsys, [*TRAIN, "--temperature", "inf", "--log-root", str(tmp_path)])
    assert "temperature: Input should be a finite number (got inf, from cli)" in err
    assert "artifacts" not in err  # the old, misleading message came from the metadata writer
    assert no_run_dirs(tmp_path)


def test_debate_train_with_single_turn(tmp_path, capsys, no_model_load):
    err = refused(capsys, [*TRAIN, "--debate-train", "rs_grpo", "--log-root", str(tmp_path)])
    assert "--debate-train rs_grpo applies to --mode debate only" in err and "add --mode debate" in err


# --- backend, device, model ---------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the case is a machine without CUDA")
def test_cuda_device_without_cuda(tmp_path, capsys, monkeypatch, no_model_load):
    monkeypatch.setenv("TINKER_LOCAL_DEVICE", "cuda")
    err = refused(capsys, [*TRAIN, "--log-root", str(tmp_path)])
    assert "TINKER_LOCAL_DEVICE='cuda' needs CUDA" in err and "set it to cpu" in err
    assert no_run_dirs(tmp_path)


def test_api_backend_without_a_key(tmp_path, capsys, monkeypatch, no_model_load):
    for name in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no key stored by `tinker auth login` either
    monkeypatch.setenv("TINKER_BACKEND", "api")
    err = refused(capsys, [*TRAIN, "--log-root", str(tmp_path / "logs")])
    assert "needs a key: set TINKER_API_KEY" in err and "unset TINKER_BACKEND" in err
    assert no_run_dirs(tmp_path)


def test_model_folder_with_only_config_json(tmp_path, capsys, no_model_load, tiny_folder):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(tiny_folder / "config.json", folder)
    err = refused(capsys, ["train", "--model", str(folder), "--env", "qa", "--dataset", "test", "-n", "8",
                           "--num-groups", "2", "--log-root", str(tmp_path / "logs")])
    assert "lacks weights (model.safetensors or pytorch_model.bin) and a tokenizer" in err
    assert no_run_dirs(tmp_path)


# --- outputs of the other commands -------------------------------------------------------------------------

def test_eval_out_naming_a_directory_is_refused_before_the_evaluation(tmp_path, capsys, no_model_load):
    err = refused(capsys, ["eval", "--model", "tiny", "--num-problems", "2", "--samples", "2", "--ks", "1",
                           "--out", str(tmp_path)])
    assert "is a directory; it names the file to write" in err


def test_package_out_naming_a_directory_with_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_metadata.json").write_text(json.dumps({"status": "completed"}))
    (tmp_path / "dest").mkdir()
    err = refused(capsys, ["package", str(run), "--out", str(tmp_path / "dest"), "--overwrite"])
    assert "is a directory; it names the archive file" in err
    assert list((tmp_path / "dest").iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-1e-4", "nan", "inf"])
def test_check_logprobs_tolerance_must_be_positive(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check-logprobs", "--model", "tiny", "--tolerance", value])
    assert exit_info.value.code == 2
    assert "--tolerance" in capsys.readouterr().err


def test_check_run_on_a_path_that_does_not_exist(tmp_path, capsys):
    err = refused(capsys, ["check-run", str(tmp_path / "no-such-run")])
    assert "does not exist" in err and "FAIL" not in err


# --- warnings, not errors ----------------------------------------------------------------------------------

def test_duplicate_rows_and_empty_prompts_are_warned_about(tmp_path, capsys):
    rows = [{"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"} for a in range(1, 7)]
    rows += [rows[0], rows[1], {"question": "  ", "answer": "#### 1"}]  # two duplicates, one empty prompt
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = cli.main(["train", "--model", "tiny", "--env", "qa", "--dataset", str(data), "-n", "8",
                     "--num-groups", "2", "--max-tokens", "32", "--seed", "1", "-s", "1", "--log-root", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert code == 0  # a warning, not an error: the run goes on
    assert "[data] warning: data set" in out
    assert "2 duplicate row(s) in 2 group(s)" in out and "gsm8k-0=gsm8k-6" in out
    assert "1 row(s) with an empty prompt (gsm8k-8)" in out
    (run,) = (tmp_path / "logs").iterdir()
    warnings = json.loads((run / "run_metadata.json").read_text())["dataset"]["warnings"]
    assert len(warnings) == 2
