"""The command line's error boundary (issue 24, point 1): what a command can anticipate (the file system,
decoding, parsing, damaged model folders and checkpoints, the network, memory) is one ``error:`` paragraph
naming the cause and the fix, exit 2; anything else is a bug, reported with its traceback and where to
report it, exit 70.

The first tests raise each anticipated class from inside a command (``resolve-model``, patched) and check
what ``cli.main`` makes of it; the rest produce the same classes for real, through the installed command
where the behaviour is the command line's own.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlrunbook import cli
from rlrunbook.backend import api_access
from rlrunbook.errors import ServiceUnreachableError

COMMAND = Path(sys.executable).with_name("rlrunbook")


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI in process; assert exit 2 with one paragraph on stderr (no traceback); return it."""
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and "\n" not in err, err
    return err


def run_command(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(COMMAND), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_refused(result: subprocess.CompletedProcess) -> str:
    err = result.stderr.strip()
    assert result.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    return line


# --- each anticipated class, raised inside a command -------------------------------------------------------

def _raising(monkeypatch, error: BaseException) -> None:
    import rlrunbook.models

    def resolve(name):
        raise error

    monkeypatch.setattr(rlrunbook.models, "resolve_model", resolve)


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    return path


def _safetensors_error():
    from safetensors import SafetensorError

    return SafetensorError("Error while deserializing header: HeaderTooLarge")


def _httpx_timeout():
    import httpx

    return httpx.ConnectTimeout("timed out")


CASES = {
    # name: (the error, given tmp_path and a file in it; what the paragraph must say)
    "permission": (lambda tmp, f: PermissionError(errno.EACCES, "Permission denied", str(tmp / "store" / "x")),
                   ["cannot use", "permission denied", "TINKER_LOCAL_STORAGE=", "Fix: make it writable"]),
    "read_only": (lambda tmp, f: OSError(errno.EROFS, "Read-only file system", str(tmp / "store" / "x")),
                  ["read-only file system", "TINKER_LOCAL_STORAGE=", "Fix: choose a path on a writable"]),
    "file_in_the_way": (lambda tmp, f: NotADirectoryError(errno.ENOTDIR, "Not a directory", str(f / "models")),
                        ["afile is a file, not a folder", "Fix: move that file"]),
    "parent_is_a_file": (lambda tmp, f: FileExistsError(errno.EEXIST, "File exists", str(f / "a" / "b")),
                         ["afile is a file, not a folder"]),
    "disk_full": (lambda tmp, f: OSError(errno.ENOSPC, "No space left on device"),
                  ["no space left on the device", "Fix: free some space"]),
    "not_utf8": (lambda tmp, f: UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte"),
                 ["not UTF-8", "byte 0xff at offset 2", "Save the file as UTF-8"]),
    "lone_surrogate": (lambda tmp, f: UnicodeEncodeError("utf-8", "name\udcff", 4, 5, "surrogates not allowed"),
                       ["lone surrogates", "Pass the value as UTF-8"]),
    "json": (lambda tmp, f: json.JSONDecodeError("Expecting value", '{"a": ', 6),
             ["does not parse", "Expecting value at line 1, column 7", "restore the file"]),
    "safetensors": (lambda tmp, f: _safetensors_error(), ["safetensors file is corrupted", "HeaderTooLarge"]),
    "network": (lambda tmp, f: ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
                ["network call failed", "ConnectionRefusedError"]),
    "network_library": (lambda tmp, f: _httpx_timeout(), ["network call failed", "ConnectTimeout"]),
    "memory": (lambda tmp, f: MemoryError(), ["ran out of memory", "Fix:"]),
    "recursion": (lambda tmp, f: RecursionError("maximum recursion depth exceeded"),
                  ["nested too deeply", "RecursionError"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_anticipated_error_is_one_paragraph(case, tmp_path, a_file, capsys, monkeypatch):
    make, expected = CASES[case]
    monkeypatch.setenv("TINKER_LOCAL_STORAGE", str(tmp_path / "store"))
    _raising(monkeypatch, make(tmp_path, a_file))
    err = refused(capsys, ["resolve-model", "tiny"])
    for part in expected:
        assert part in err, err


def test_a_bug_prints_its_traceback_and_where_to_report_it(capsys, monkeypatch):
    _raising(monkeypatch, ZeroDivisionError("division by zero"))
    code = cli.main(["resolve-model", "tiny"])
    err = capsys.readouterr().err
    assert code == 70, err
    assert "Traceback (most recent call last)" in err and "ZeroDivisionError: division by zero" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("This is a bug in rlrunbook") and "report it with the command and this traceback" in last


def test_an_os_error_without_a_path_and_an_unknown_reason_is_a_bug(capsys, monkeypatch):
    _raising(monkeypatch, OSError(errno.EIO, "Input/output error"))
    assert cli.main(["resolve-model", "tiny"]) == 70
    assert "This is a bug in rlrunbook" in capsys.readouterr().err


# --- the same classes for real --------------------------------------------------------------------------------

def test_cache_dir_that_is_a_file(a_file):
    line = assert_refused(run_command("resolve-model", "tiny", env={"RLRUNBOOK_CACHE_DIR": str(a_file)}))
    assert f"{a_file} is a file, not a folder" in line and f"RLRUNBOOK_CACHE_DIR={a_file}" in line


def test_cache_dir_under_a_file(a_file, capsys, monkeypatch):
    monkeypatch.setenv("RLRUNBOOK_CACHE_DIR", str(a_file / "cache"))
    err = refused(capsys, ["resolve-model", "tiny"])
    assert f"{a_file} is a file, not a folder" in err and "set RLRUNBOOK_CACHE_DIR to a usable folder" in err


def test_argument_that_is_not_utf8(tmp_path):
    result = subprocess.run([os.fsencode(str(COMMAND)), b"train", b"--model", b"tiny", b"--name", b"caf\xe9",
                             b"--log-root", os.fsencode(str(tmp_path))], capture_output=True, timeout=120)
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "argument 5 ('caf\\udce9') is not UTF-8 text (byte 0xe9 at offset 3)" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "--learning-rate -1.0 must be > 0"),
    ("-1e-4", "--learning-rate -0.0001 must be > 0"),  # argparse alone took "-1e-4" for an option
    ("-inf", "learning_rate: Input should be a finite number (got -inf, from cli)"),
])
def test_a_negative_number_is_refused_as_a_value_not_read_as_an_option(value, message, capsys):
    err = refused(capsys, ["train", "--model", "tiny", "--learning-rate", value])
    assert message in err and "expected one argument" not in err


@pytest.mark.parametrize(("name", "content", "message"), [
    ("config.json", "{not json", "config.json' is not readable JSON (JSONDecodeError"),
    ("config.json", "[1, 2]", "config.json' holds a JSON list, not an object"),
    ("tokenizer_config.json", b"\xff\xfe{}", "tokenizer_config.json' is not readable JSON (UnicodeDecodeError"),
    ("model.safetensors", b"\xff" * 8 + b"{}", "model.safetensors' is not a readable safetensors file"),
])
def test_a_damaged_model_folder_is_refused_naming_the_file(tmp_path, tiny_folder, capsys, name, content, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    path = folder / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    err = refused(capsys, ["train", "--model", str(folder), "--log-root", str(tmp_path / "logs")])
    assert message in err and "Rebuild or re-download the model" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "no_such_architecture"}, "does not describe a model transformers can build"),
    ({"vocab_size": -5}, "sets vocab_size to -5: a tensor size must be a positive integer"),
    ({"hidden_size": 10**12}, "sets hidden_size to 1000000000000: a tensor size must be a positive integer"),
])
def test_an_architecture_no_tensor_can_hold_is_refused_before_loading(tmp_path, tiny_folder, capsys, change,
                                                                       message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    err = refused(capsys, ["train", "--model", str(folder), "--log-root", str(tmp_path / "logs")])
    assert message in err and not (tmp_path / "logs").exists()


def test_a_damaged_built_in_cache_names_the_folder_to_delete(tmp_path, monkeypatch, capsys):
    from rlrunbook.models.registry import resolve_model

    monkeypatch.setenv("RLRUNBOOK_CACHE_DIR", str(tmp_path / "cache"))
    folder = resolve_model("tiny")
    (folder / "config.json").write_text("{not json")
    capsys.readouterr()  # the build's progress lines
    err = refused(capsys, ["train", "--model", "tiny", "--log-root", str(tmp_path / "logs")])
    assert "config.json' is not readable JSON" in err and f"rm -r '{folder}'" in err


@pytest.mark.slow
def test_cookbook_with_an_unknown_renderer_names_the_option_and_the_renderers(tmp_path):
    result = run_command("cookbook", "--renderer", "no_such_renderer", "tinker_cookbook.recipes.rl_loop",
                         "model_name=tiny", "max_steps=1", f"log_path={tmp_path / 'run'}",
                         env={"TINKER_BACKEND": "local"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--renderer 'no_such_renderer' is not a renderer" in result.stderr and "qwen3_instruct" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cookbook_a_recipe_argument_the_cookbook_refuses_is_one_paragraph(tmp_path):
    """tinker-cookbook's own ConfigurationError (its check of a recipe argument) is the user's to fix: exit 2."""
    result = run_command("cookbook", "--renderer", "qwen3_instruct", "tinker_cookbook.recipes.math_rl.train",
                         "model_name=tiny", "env=arithmetic", "max_steps_off_policy=-1",
                         "loss_fn=importance_sampling", "max_steps=1", f"log_path={tmp_path / 'run'}",
                         env={"TINKER_BACKEND": "local"})
    err = result.stderr
    assert result.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "ConfigurationError: AsyncConfig needs max_steps_off_policy >= 0" in err
    assert "change that recipe argument" in err


@pytest.mark.slow
def test_cookbook_with_an_unknown_recipe(tmp_path):
    result = run_command("cookbook", "tinker_cookbook.recipes.no_such_recipe", env={"TINKER_BACKEND": "local"})
    err = result.stderr
    assert result.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "recipe 'tinker_cookbook.recipes.no_such_recipe' cannot be run (no such module)" in err
    assert "tinker_cookbook.recipes.math_rl.train" in err  # the recipes there are, named


@pytest.mark.slow
def test_cookbook_with_a_module_whose_parent_does_not_exist():
    result = run_command("cookbook", "no_such_package.recipe", env={"TINKER_BACKEND": "local"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "recipe 'no_such_package.recipe' cannot be run (ModuleNotFoundError" in result.stderr


# --- the hosted service: a bounded budget, stated when spent ---------------------------------------------------

@pytest.fixture
def silent_server():
    """A TCP port that accepts connections and never answers (a service behind a dead link)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


def test_a_service_that_never_answers_is_given_up_within_the_budget(silent_server):
    pauses: list[float] = []
    budget = api_access.Budget(timeout_s=0.5, attempts=3)
    start = time.monotonic()
    with pytest.raises(ServiceUnreachableError) as caught:
        api_access.check_reachable(silent_server, budget, sleep=pauses.append)
    elapsed = time.monotonic() - start
    assert pauses == [1.0, 2.0]  # 1 s, then 2 s between the three attempts
    assert 1.5 <= elapsed < 3 * 1.5 + 5, elapsed  # three attempts of 0.5 s, each bounded
    message = str(caught.value)
    assert f"the Tinker service at {silent_server} did not answer" in message
    assert "3 attempt(s) of 0.5 s, 1 + 2 s apart (RLRUNBOOK_API_TIMEOUT_S, RLRUNBOOK_API_ATTEMPTS)" in message
    assert "ReadTimeout" in message and "unset TINKER_BACKEND" in message


def test_an_answer_ends_the_check_at_once():
    calls: list[str] = []
    api_access.check_reachable("http://x", api_access.Budget(1.0, 3), probe=lambda url, t: calls.append(url),
                               sleep=lambda s: pytest.fail("no pause after an answer"))
    assert calls == ["http://x"]


@pytest.mark.parametrize(("name", "value"), [("RLRUNBOOK_API_TIMEOUT_S", "0"), ("RLRUNBOOK_API_TIMEOUT_S", "nan"),
                                             ("RLRUNBOOK_API_ATTEMPTS", "0"), ("RLRUNBOOK_API_ATTEMPTS", "1.5")])
def test_the_budget_variables_are_checked(name, value):
    with pytest.raises(ValueError, match=rf"{name}='{value}' must be"):
        api_access.Budget.from_env({name: value})


@pytest.mark.slow
def test_train_with_a_key_but_no_network_ends_within_the_budget(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: every attempt is refused
    start = time.monotonic()
    result = run_command("train", "--model", "tiny", "--log-root", str(tmp_path / "logs"), timeout=120,
                         env={"TINKER_BACKEND": "api", "TINKER_API_KEY": "tml-" + "0" * 40,
                              "TINKER_BASE_URL": f"http://127.0.0.1:{port}", "RLRUNBOOK_API_TIMEOUT_S": "1",
                              "RLRUNBOOK_API_ATTEMPTS": "2"})
    line = assert_refused(result)
    assert time.monotonic() - start < 60
    assert f"the Tinker service at http://127.0.0.1:{port} did not answer: 2 attempt(s) of 1 s, 1 s apart" in line
    assert "ConnectError" in line and not (tmp_path / "logs").exists()


# --- the run being resumed ------------------------------------------------------------------------------------

def fake_run(root):
    """A run directory with metadata, one train-log row per step and a checkpoint at step 2 (stand-in tensors)."""
    import torch

    from rlrunbook.rl.setup.config import TrainConfig
    from rlrunbook.rl.setup.config_checks import validate
    from rlrunbook.run.checkpoint_format import Checkpoint, capture_rng, save_checkpoint

    stored = validate(TrainConfig(model="tiny", env="qa", dataset="test", num_rollouts=4, steps=4,
                                  checkpoint={"every": 2}, log_root=str(root)))
    run = root / "20260101-000000_grpo_qa_run"
    run.mkdir(parents=True)
    (run / "run_metadata.json").write_text(json.dumps({"config": stored.to_dict(), "dataset": {}}))
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": k}) + "\n" for k in range(2)))
    for k in range(2):
        (run / f"training_step_{k}.json").write_text("{}")
        (run / f"baseline_{k}.json").write_text("{}")
    save_checkpoint(run, Checkpoint(2, stored.to_dict(), {"w": torch.ones(2)}, None, capture_rng()))
    return run


@pytest.mark.parametrize(("damage", "message"), [
    (lambda run: (run / "run_metadata.json").write_text('{"config": {"mod'),
     "run_metadata.json of the run being resumed is not readable JSON (JSONDecodeError"),
    (lambda run: (run / "train_log.jsonl").write_text('{"step": 0}\n{"step": 1\n'),
     "train_log.jsonl line 2 is not readable JSON"),
    (lambda run: (run / "training_step_1.json").write_bytes(b"\xff{}"),
     "training_step_1.json, a record of the steps before 2, cannot be read ('utf-8' codec can't decode byte 0xff"),
    (lambda run: (run / "checkpoints" / "step_000002" / "checkpoint.json").write_text('{"step": 2, "conf'),
     "checkpoint.json"),
    (lambda run: (run / "checkpoints" / "step_000002" / "rng.json").write_text('{"python": 1}'), "rng.json"),
])
def test_a_damaged_run_being_resumed_is_refused_before_anything_loads(tmp_path, capsys, damage, message):
    run = fake_run(tmp_path / "logs")
    damage(run)
    err = refused(capsys, ["train", "--resume-from", str(run), "-s", "4", "--log-root", str(tmp_path / "new")])
    assert message in err
    assert not (tmp_path / "new").exists()


# --- misleading messages ------------------------------------------------------------------------------------

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.slow
def test_a_missing_model_is_named_before_the_data_set_is_fetched(tmp_path, command):
    """Found as a GPU preset's hub model, missing on this machine, reported as the data set's connection error."""
    result = run_command(command, "--model", "Org/no-such-model", "--env", "math", "--dataset", "gsm8k",
                         *(["--log-root", str(tmp_path / "logs")] if command == "train" else []), env=OFFLINE)
    line = assert_refused(result)
    assert line.startswith("error: model 'Org/no-such-model' is not a built-in"), line
    assert "gsm8k" not in result.stderr and not (tmp_path / "logs").exists()
