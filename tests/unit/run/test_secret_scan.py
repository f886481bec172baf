"""Secrets never leave in artifacts: redaction of configs and command lines, resume without stored secrets,
and the content scan of ``package`` (private keys and token shapes, by file and line).

The run-level tests train ``tiny`` for 2 steps in process (a few seconds each) and then look at the
bytes of every file of the run directory, so a leak through any writer is caught, not only through
the ones a test names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyed_task import KEYED_TASK
from rlrunbook import cli
from rlrunbook.run.jsonio import REDACTED
from rlrunbook.run.redaction import redact_argv, redact_config, secret_config_values, secret_env_name
from rlrunbook.run.secret_scan import scan_file
from rlrunbook.run.tools import find_secrets

SECRET = "sk-fake-123456"  # the shape of the report: an OpenAI-style key of a made-up value


# --- redaction --------------------------------------------------------------------------------------------

def test_redact_argv_covers_flags_overrides_and_sweeps():
    argv = ["train", f"extra.api_key={SECRET}", "--sweep", "extra.judge.password=a1b2c3d4,e5f6g7h8",
            "--api-key", "k-123456", "--hf-token=hf_abcdef123", "steps=4", "--stop-token", "7",
            "--name", f"run-with-{SECRET}-inside", "loss.kl_coef=0.1"]
    out = redact_argv(argv, secrets=[SECRET])
    assert out == ["train", f"extra.api_key={REDACTED}", "--sweep", f"extra.judge.password={REDACTED}",
                   "--api-key", REDACTED, f"--hf-token={REDACTED}", "steps=4", "--stop-token", "7",
                   "--name", f"run-with-{REDACTED}-inside", "loss.kl_coef=0.1"]


def test_redact_config_at_any_depth_and_whole_sections():
    config = {"steps": 2, "extra": {"api_key": SECRET, "judge": {"auth_token": "t-123456789", "model": "m"},
                                    "credentials": {"user": "u", "pw": "p-123456"}, "stop_token": 5,
                                    "token": None}}
    redacted = redact_config(config)
    assert redacted == {"steps": 2, "extra": {"api_key": REDACTED, "judge": {"auth_token": REDACTED, "model": "m"},
                                              "credentials": REDACTED, "stop_token": 5, "token": None}}
    assert sorted(secret_config_values(config)) == sorted([SECRET, "t-123456789", "p-123456"])
    assert secret_env_name("extra.judge.api_key") == "RLRUNBOOK_EXTRA_JUDGE_API_KEY"


# --- a run with a secret in its config -------------------------------------------------------------------

# extra.api_key must be an option the task declares: a plug-in task with credentials among its options.
TRAIN = ["train", "--model", "tiny", "--env", KEYED_TASK, "--dataset", "test", "-n", "8", "--num-groups", "2",
         "--max-tokens", "32", "--seed", "1", "--checkpoint-every", "1"]


def _run(log_root: Path, *args: str) -> tuple[int, Path | None]:
    before = set(log_root.iterdir()) if log_root.is_dir() else set()
    code = cli.main([*TRAIN, "--log-root", str(log_root), *args])
    new = set(log_root.iterdir()) - before if log_root.is_dir() else set()
    return code, (new.pop() if new else None)


def _files_holding(root: Path, value: str) -> list[str]:
    needle = value.encode()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes())


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("secret-runs")
    code, run = _run(root, "-s", "2", f"extra.api_key={SECRET}")
    assert code == 0
    return root, run


def test_a_secret_config_value_is_in_no_file_of_the_run(secret_run):
    import json

    _, run = secret_run
    assert _files_holding(run, SECRET) == []
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert f"extra.api_key={REDACTED}" in metadata["argv"]  # the command line it was given, redacted
    assert metadata["config"]["extra"] == {"api_key": REDACTED}
    manifest = json.loads((run / "checkpoints" / "step_000002" / "checkpoint.json").read_text())
    assert manifest["config"]["extra"] == {"api_key": REDACTED}
    # and what the run wrote is not mistaken for a secret by package's content scan
    assert find_secrets(run, {}) == []


def test_resume_takes_the_secret_again_from_the_command_line_or_the_environment(secret_run, monkeypatch, capsys):
    root, run = secret_run
    monkeypatch.delenv("RLRUNBOOK_EXTRA_API_KEY", raising=False)
    code, made = _run(root, "--resume-from", str(run), "-s", "3")
    message = capsys.readouterr().err
    assert code == 2 and made is None  # refused before a run directory exists
    assert "extra.api_key is a secret" in message and "RLRUNBOOK_EXTRA_API_KEY" in message

    monkeypatch.setenv("RLRUNBOOK_EXTRA_API_KEY", SECRET)
    code, from_env = _run(root, "--resume-from", str(run), "-s", "3")
    assert code == 0 and _files_holding(from_env, SECRET) == []
    monkeypatch.delenv("RLRUNBOOK_EXTRA_API_KEY")
    # another value on the command line is not "a changed option": secrets are not compared
    code, from_cli = _run(root, "--resume-from", str(run), "-s", "3", "extra.api_key=sk-other-987654")
    assert code == 0 and _files_holding(from_cli, "sk-other-987654") == []


# --- package's content scan -------------------------------------------------------------------------------

# Made-up values in the shapes the scan knows (none is a real credential).
SHAPES = {
    "private key": "-----BEGIN OPENSSH PRIVATE KEY-----",
    "OpenAI-style API key (sk-...)": "sk-proj-abc123def456",
    "AWS access key id": "AKIAABCDEFGHIJKLMNOP",
    "GitHub token": "ghp_" + "a1" * 18,
    "Hugging Face token": "hf_" + "x9" * 15,
    "Slack token": "xoxb-1234567890-abc",
    "Google API key": "AIza" + "b" * 35,
    "Stripe live key": "sk_live_" + "c3" * 8,
    "JSON web token": "eyJhbGciOiJI.eyJzdWIiOiIx.c2lnbmF0dXJl",
}
NOT_SECRETS = [
    "a" * 64,  # a sha256 hex digest
    "0123456789abcdef0123456789abcdef01234567",  # a git commit
    "task-reward 0.5 and ask-12345678 and desk-lamp9000",  # "sk-" inside words
    "sk-learn sk-abcdefghij",  # no digit: a word, not a key
    '"extra.api_key": "override"', f'"api_key": "{REDACTED}"', "max_tokens=64 stop_token=2",
    "AKIA1234",  # too short
]


@pytest.mark.parametrize("kind", SHAPES)
def test_scan_finds_each_shape_with_its_line(tmp_path, kind):
    path = tmp_path / "notes.txt"
    path.write_text(f"line one\nline two has {SHAPES[kind]} in it\n")
    assert [str(f) for f in scan_file(path, "notes.txt")] == [f"notes.txt:2: {kind}"]


def test_scan_ignores_what_runs_write(tmp_path):
    path = tmp_path / "data.json"
    path.write_text("\n".join(NOT_SECRETS))
    assert scan_file(path, "data.json") == []


def test_scan_finds_a_key_across_the_chunk_boundary_with_the_right_line(tmp_path):
    path = tmp_path / "big.bin"
    lines = b"x" * 99 + b"\n"
    head = lines * ((1 << 20) // len(lines))  # 10485 full lines, then the key straddles 1 MiB
    path.write_bytes(head + b"y" * 70 + SHAPES["private key"].encode() + b"\n")
    assert [str(f) for f in scan_file(path, "big.bin")] == [f"big.bin:{len(head) // 100 + 1}: private key"]


def test_package_refuses_keys_and_token_shapes_and_allow_secrets_overrides(secret_run, tmp_path, capsys,
                                                                          monkeypatch):
    import shutil

    for name in [k for k in __import__("os").environ if "KEY" in k or "TOKEN" in k]:
        monkeypatch.delenv(name)  # the value of sk-fake-123456 is in no variable: the shape alone finds it
    _, run = secret_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "credentials.json").write_text('{\n "type": "service_account",\n "private_key": '
                                           '"-----BEGIN PRIVATE KEY-----\\nMIIEfake\\n-----END PRIVATE KEY-----\\n"\n}\n')
    (copy / "deploy.key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAfake\n")
    (copy / "notes.txt").write_text(f"first\nthe key is {SECRET}\n")
    out = tmp_path / "run.tar.gz"
    assert cli.main(["package", str(copy), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    for finding in ("credentials.json:3: private key", "deploy.key:1: private key",
                    "notes.txt:2: OpenAI-style API key (sk-...)", "deploy.key: credentials file"):
        assert finding in err
    assert SECRET not in err and not out.exists()
    assert cli.main(["package", str(copy), "--out", str(out), "--allow-secrets"]) == 0 and out.is_file()


# --- package's scan of names ------------------------------------------------------------------------------

KEY_NAMES = {  # a file name holding each shape, and what the finding shows of it
    "sk-proj-AbC123def456xyz.txt": ("<redacted>.txt", "OpenAI-style API key (sk-...)"),
    "ghp_" + "a1" * 18: ("<redacted>", "GitHub token"),
    "AKIAABCDEFGHIJKLMNOP": ("<redacted>", "AWS access key id"),
    "notes_AKIAABCDEFGHIJKLMNOP.json": ("notes_<redacted>.json", "AWS access key id"),
    "run-hf_" + "x9" * 15 + ".log": ("run-<redacted>.log", "Hugging Face token"),
}


def _bare_run(root: Path) -> Path:
    """A directory that ``package`` takes for a run: a ``run_metadata.json`` and a clean log."""
    root.mkdir()
    (root / "run_metadata.json").write_text('{"status": "completed"}\n')
    (root / "train_log.jsonl").write_text('{"step": 0}\n')
    return root


def _clean_environment(monkeypatch) -> None:
    import os

    for name in [k for k in os.environ if "KEY" in k or "TOKEN" in k or "SECRET" in k or "PASS" in k]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name", KEY_NAMES)
def test_package_refuses_a_file_whose_name_is_a_key_without_printing_it(tmp_path, capsys, monkeypatch, name):
    _clean_environment(monkeypatch)
    run = _bare_run(tmp_path / "run")
    (run / name).write_text("nothing secret in here\n")
    shown, kind = KEY_NAMES[name]
    assert find_secrets(run, {}) == [f"{shown}: {kind} in its name"]
    out = tmp_path / "run.tar.gz"
    assert cli.main(["package", str(run), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert f"{shown}: {kind} in its name" in captured.err
    assert name not in captured.err + captured.out and not out.exists()
    assert cli.main(["package", str(run), "--out", str(out), "--allow-secrets"]) == 0 and out.is_file()


def test_a_secret_named_directory_hides_its_name_in_every_finding_below_it(tmp_path):
    key = "sk-proj-AbC123def456xyz"
    run = _bare_run(tmp_path / "run")
    (run / key).mkdir()
    (run / key / "notes.txt").write_text(f"line\n{SHAPES['private key']}\n")
    (run / key / ".netrc").write_text("machine example.org\n")
    (run / "keep").mkdir()
    (run / "keep" / "db_s3cr3t-value-123.bin").write_bytes(b"\0")
    findings = find_secrets(run, {"DB_PASSWORD": "s3cr3t-value-123"})
    assert findings == [
        "keep/db_<redacted>.bin: DB_PASSWORD in its name",  # the value of a secret variable, as in contents
        "<redacted>: OpenAI-style API key (sk-...) in its name",  # once, for the directory itself
        "<redacted>/.netrc: credentials file",
        "<redacted>/notes.txt:2: private key",
    ]
    assert not any(key in f or "s3cr3t" in f for f in findings)


def test_a_name_holding_a_key_in_another_form_is_found_and_hidden_whole(tmp_path):
    import base64

    encoded = base64.urlsafe_b64encode(b"sk-proj-AbC123def456xyz").decode().rstrip("=")
    run = _bare_run(tmp_path / "run")
    (run / f"{encoded}.txt").write_text("x\n")
    assert find_secrets(run, {}) == ["<redacted>: OpenAI-style API key (sk-...) (in base64) in its name"]


def test_a_run_directory_named_for_a_key_is_refused(tmp_path):
    run = _bare_run(tmp_path / "20250101-000000_single_turn_qa_sk-proj-AbC123def456xyz")
    assert find_secrets(run, {}) == [("20250101-000000_single_turn_qa_<redacted> (the run directory): "
                                      "OpenAI-style API key (sk-...) in its name")]


def test_the_names_a_run_writes_hold_no_secret(secret_run):
    """Step files, checkpoints and their tensors: the name scan finds nothing in what a run writes."""
    from rlrunbook.run.secret_scan import scan_name

    _, run = secret_run
    names = [p.name for p in run.rglob("*")] + [run.name]
    assert len(names) > 10 and [n for n in names if scan_name(n)] == []
