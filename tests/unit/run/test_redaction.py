"""Secrets known by their value, not only by their key's name (issue 24, point 4).

A value that holds a credential (a token shape, a URL's ``user:password``, a private-key block) is withheld
or cut out wherever it would be written: ``run_metadata.json`` (config, argv, environment), ``checkpoint.json``,
run-directory names, the W&B config (test_wandb_sink.py), and ``package`` archives, which also refuse
credentials files by name and keys held compressed, base64-encoded or as UTF-16. A resume takes such a
value again, like a secret-named one. All values below are made up in the shapes of real ones.
"""

from __future__ import annotations

import base64
import bz2
import gzip
import io
import json
import lzma
import zipfile
from pathlib import Path

import pytest
from keyed_task import KEYED_TASK

from rlrunbook import cli
from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.resume import withheld_keys
from rlrunbook.rl.setup.config_sources import sweep_name
from rlrunbook.run import secret_forms
from rlrunbook.run.jsonio import REDACTED
from rlrunbook.run.metadata import filtered_environment
from rlrunbook.run.redaction import (
    credential_kind,
    redact_argv,
    redact_config,
    scrub_credentials,
    secret_values,
    withheld_paths,
)
from rlrunbook.run.secret_scan import PATTERNS, scan_file
from rlrunbook.run.tools import find_secrets, is_credentials_file

OPENAI_KEY = "sk-proj-Zx81bQ0fakeKey7"  # under extra.openai_key: a name outside the secret-name lists
PASSPHRASE = "ghp_" + "Fk3" * 12  # under extra.passphrase
URL_PASSWORD = "pW-4f9x2Lq"
URL = f"https://alice:{URL_PASSWORD}@hub.example.org/data"
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEfakefakefake\n-----END RSA PRIVATE KEY-----\n"
# One made-up value per pattern of run.secret_scan, in the shape the pattern names.
SHAPES = {
    "private key": "-----BEGIN EC PRIVATE KEY-----",
    "PuTTY private key": "PuTTY-User-Key-File-3: ssh-ed25519",
    "OpenAI-style API key (sk-...)": OPENAI_KEY,
    "AWS access key id": "AKIAQWERTYUIOPASDFGH",
    "AWS secret access key": "aws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY12",
    "GitHub token": PASSPHRASE,
    "GitLab token": "glpat-abcDEF123456ghiJKL78",
    "Hugging Face token": "hf_" + "Qw7" * 11,
    "Slack token": "xoxp-2718281828-abcdef",
    "Slack webhook": "https://hooks.slack.com/services/T0FAKE000/B0FAKE000/abcdefghij0123456789",
    "Google API key": "AIza" + "Sy" * 17 + "x",
    "Stripe live key": "rk_live_" + "4eC39HqLyjWDarjt",
    "npm token": "npm_" + "a1B2c3D4e5" * 3 + "f6G7h8",
    "PyPI token": "pypi-AgEIcHlwaS5vcmc" + "Ab3" * 17,
    "Tinker API key": "tml-0a1b2c3d4e5f6a7b8c9d0e",
    "JSON web token": "eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.SflKxwRJSMeKKF2QT4",
    "URL with credentials": URL,
}
NOT_CREDENTIALS = ["smollm2-135m", "Qwen/Qwen2.5-1.5B-Instruct", "https://hub.example.org/data", "git@github.com:a/b",
                   "http://localhost:8000/v1", "sk-learn", "task-reward", "a" * 64, "run_a-learning_rate-0.0003",
                   "tokens.json", "https://<redacted>@hub.example.org/data"]


def test_every_pattern_has_a_shape_here():
    assert set(SHAPES) == set(PATTERNS)


@pytest.mark.parametrize("kind", SHAPES)
def test_a_value_in_each_shape_is_a_credential(kind):
    assert credential_kind(f"the value: {SHAPES[kind]} (end)") == kind


@pytest.mark.parametrize("text", NOT_CREDENTIALS)
def test_what_runs_name_is_not_a_credential(text):
    assert credential_kind(text) is None


# --- run records: config, argv, environment -------------------------------------------------------------

def test_config_values_holding_credentials_are_withheld_under_any_key():
    config = {"steps": 2, "name": "run", "reward": {"blocklist": ["ok", OPENAI_KEY]},
              "extra": {"openai_key": OPENAI_KEY, "passphrase": PASSPHRASE, "endpoint": URL, "plain": "abc",
                        "api_key": "short1", "judges": [{"model": "m", "token": "t-1"}], "nothing": None}}
    redacted = redact_config(config)
    assert redacted == {"steps": 2, "name": "run", "reward": {"blocklist": REDACTED},
                        "extra": {"openai_key": REDACTED, "passphrase": REDACTED, "endpoint": REDACTED,
                                  "plain": "abc", "api_key": REDACTED, "judges": REDACTED, "nothing": None}}
    assert withheld_paths(config) == ["reward.blocklist", "extra.openai_key", "extra.passphrase", "extra.endpoint",
                                      "extra.api_key", "extra.judges"]


def test_command_lines_and_environment_lose_the_credentials_only():
    argv = ["train", f"extra.openai_key={OPENAI_KEY}", "--sweep", f"extra.model_key={PASSPHRASE},{OPENAI_KEY}",
            "--dataset", URL, "--name", "qa", "--comment", f"see {SHAPES['Slack webhook']}"]
    assert redact_argv(argv) == ["train", f"extra.openai_key={REDACTED}", "--sweep",
                                 f"extra.model_key={REDACTED},{REDACTED}", "--dataset",
                                 f"https://{REDACTED}@hub.example.org/data", "--name", "qa", "--comment",
                                 f"see https://{REDACTED}"]
    environ = {"TINKER_BASE_URL": URL, "HF_ENDPOINT": "https://hub.example.org", "TINKER_NOTE": f"x {OPENAI_KEY}"}
    assert filtered_environment(environ) == {"HF_ENDPOINT": "https://hub.example.org",
                                             "TINKER_BASE_URL": f"https://{REDACTED}@hub.example.org/data",
                                             "TINKER_NOTE": f"x {REDACTED}"}
    # and the writer scrubs them from every other string it writes
    assert set(secret_values(environ)) == {f"alice:{URL_PASSWORD}", OPENAI_KEY}
    assert scrub_credentials("\udcff lone surrogate, then " + OPENAI_KEY) == f"\udcff lone surrogate, then {REDACTED}"


def test_resume_asks_for_withheld_keys_and_reads_older_manifests_by_name():
    stored = {"steps": 2, "extra": {"openai_key": REDACTED, "api_key": REDACTED, "note": REDACTED}}
    assert withheld_keys(stored, ("extra.openai_key", "extra.api_key")) == ["extra.openai_key", "extra.api_key"]
    # a manifest written before `withheld` existed withheld the secret-named keys only; "note" is data there
    assert withheld_keys(stored, None) == ["extra.api_key"]


# --- a real run with credentials under names that are not secret ----------------------------------------

TRAIN = ["train", "--model", "tiny", "--env", KEYED_TASK, "--dataset", "test", "-n", "8", "--num-groups", "2",
         "--max-tokens", "32", "--seed", "1", "--checkpoint-every", "1"]
RECORDED_URL_VARIABLE = "RLRUNBOOK_TEST_NOTES_URL"  # recorded (prefix RLRUNBOOK_), read by nothing


def _run(log_root: Path, *args: str) -> tuple[int, Path | None]:
    before = set(log_root.iterdir()) if log_root.is_dir() else set()
    code = cli.main([*TRAIN, "--log-root", str(log_root), *args])
    new = set(log_root.iterdir()) - before if log_root.is_dir() else set()
    return code, (new.pop() if new else None)


def _files_holding(root: Path, *values: str) -> list[str]:
    return sorted(f"{p.relative_to(root)}: {v}" for p in root.rglob("*") if p.is_file()
                  for v in values if v.encode() in p.read_bytes())


@pytest.fixture(scope="module")
def credential_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("credential-runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RECORDED_URL_VARIABLE, URL)
        code, run = _run(root, "-s", "2", f"extra.openai_key={OPENAI_KEY}", f"extra.passphrase={PASSPHRASE}")
    assert code == 0
    return root, run


def test_a_run_writes_no_credential_it_was_given(credential_run):
    _, run = credential_run
    assert _files_holding(run, OPENAI_KEY, PASSPHRASE, URL_PASSWORD) == []
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert metadata["config"]["extra"] == {"openai_key": REDACTED, "passphrase": REDACTED}
    assert f"extra.openai_key={REDACTED}" in metadata["argv"] and f"extra.passphrase={REDACTED}" in metadata["argv"]
    assert metadata["environment"][RECORDED_URL_VARIABLE] == f"https://{REDACTED}@hub.example.org/data"
    manifest = json.loads((run / "checkpoints" / "step_000002" / "checkpoint.json").read_text())
    assert manifest["config"]["extra"] == {"openai_key": REDACTED, "passphrase": REDACTED}
    assert manifest["withheld"] == ["extra.openai_key", "extra.passphrase"]
    assert find_secrets(run, {}) == []


def test_resume_takes_credentials_again_like_secret_named_values(credential_run, monkeypatch, capsys):
    root, run = credential_run
    code, made = _run(root, "--resume-from", str(run), "-s", "3")
    assert code == 2 and made is None  # "<redacted>" is not resumed with as if it were the key
    assert "extra.openai_key is a secret" in capsys.readouterr().err
    monkeypatch.setenv("RLRUNBOOK_EXTRA_OPENAI_KEY", OPENAI_KEY)
    code, resumed = _run(root, "--resume-from", str(run), "-s", "3", f"extra.passphrase={PASSPHRASE}")
    assert code == 0, capsys.readouterr().err
    assert _files_holding(resumed, OPENAI_KEY, PASSPHRASE) == []
    sources = json.loads((resumed / "run_metadata.json").read_text())["config_sources"]
    assert sources["extra.openai_key"] == "env:RLRUNBOOK_EXTRA_OPENAI_KEY" and sources["extra.passphrase"] != "default"


# --- run-directory names --------------------------------------------------------------------------------

def test_a_name_holding_a_credential_is_refused_before_any_directory(tmp_path, capsys):
    code, made = _run(tmp_path / "logs", "--name", OPENAI_KEY)  # `--name $OPENAI_API_KEY`, a slip of the shell
    err = capsys.readouterr().err
    assert code == 2 and made is None and not (tmp_path / "logs").exists()
    assert "looks like a credential (OpenAI-style API key (sk-...))" in err and OPENAI_KEY not in err


@pytest.mark.parametrize("name", [f"run-{OPENAI_KEY}", f"exp_{PASSPHRASE}", f"v1.{OPENAI_KEY}"])
def test_a_credential_after_a_separator_in_a_name_is_refused(name):
    from rlrunbook.run.paths import _check_component

    with pytest.raises(ConfigError, match="looks like a credential"):
        _check_component("name", name)
    assert _check_component("name", "grpo_qa_mask-run1") == "grpo_qa_mask-run1"  # "sk-" inside a word is not


def test_swept_secrets_are_not_spelled_in_run_names(capsys):
    names = [sweep_name("run", {"extra.openai_key": value, "learning_rate": 0.001})
             for value in (OPENAI_KEY, PASSPHRASE)]
    assert names[0] != names[1] and all(n.startswith("run-openai_key-secret-") for n in names)
    assert sweep_name("run", {"extra.api_key": "k1"}).startswith("run-api_key-secret-")  # secret by name
    code = cli.main(["show-config", "--model", "tiny", "--env", KEYED_TASK, "--sweep", f"extra.openai_key={OPENAI_KEY},{PASSPHRASE}"])
    out = capsys.readouterr().out
    assert code == 0 and OPENAI_KEY not in out and PASSPHRASE not in out
    assert out.count("name: run-openai_key-secret-") == 2


# --- package: credentials files, and keys in other forms ------------------------------------------------

CREDENTIAL_FILES = [".git-credentials", ".npmrc", ".pypirc", "server.ppk", "token", ".hf_token", "api-token.txt",
                    "api_key.txt", "client_secret.json", ".pgpass", ".env.local"]
RUN_FILES = ["run_metadata.json", "train_log.jsonl", "training_step_0.json", "tokens.json", "tokenizer.json",
             "checkpoint.json", "adapter.safetensors", "report.png", "validation.jsonl", "stop_token_ids.json"]


@pytest.mark.parametrize("name", CREDENTIAL_FILES)
def test_credentials_files_are_known_by_name(name):
    assert is_credentials_file(name)


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_runs_own_files_are_not_credentials_files(name):
    assert not is_credentials_file(name)


def _zip(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


PLAIN = f"notes\n{PEM}".encode()
FORMS = {  # file name: (content, the finding)
    "notes.txt.gz": (gzip.compress(PLAIN), "notes.txt.gz:2: private key (in gzip)"),
    "notes.txt.bz2": (bz2.compress(PLAIN), "notes.txt.bz2:2: private key (in bzip2)"),
    "notes.txt.xz": (lzma.compress(PLAIN), "notes.txt.xz:2: private key (in xz)"),
    "notes.zip": (_zip("inner/notes.txt", PLAIN), "notes.zip:2: private key (in zip member inner/notes.txt)"),
    "notes.b64": (b"head\n" + base64.encodebytes(PLAIN), "notes.b64:2: private key (in base64)"),
    "config.json": (json.dumps({"k": base64.urlsafe_b64encode(PLAIN).decode()}).encode(),
                    "config.json:1: private key (in base64)"),
    "notes.utf16": (PLAIN.decode().encode("utf-16"), "notes.utf16:2: private key (in UTF-16)"),
    "notes.utf16be": (b"x" + PLAIN.decode().encode("utf-16-be"), "notes.utf16be:2: private key (in UTF-16)"),
    "nested.txt": (b"x=" + base64.b64encode(gzip.compress(PLAIN)), "nested.txt:1: private key (in base64, gzip)"),
    "aws.ini": (f"[default]\n{SHAPES['AWS secret access key']}\n".encode(), "aws.ini:2: AWS secret access key"),
    "hook.txt": (f"post to {SHAPES['Slack webhook']}\n".encode(), "hook.txt:1: Slack webhook"),
}


@pytest.mark.parametrize("name", FORMS)
def test_keys_are_found_in_the_forms_a_file_holds_them(tmp_path, name):
    content, finding = FORMS[name]
    (tmp_path / name).write_bytes(content)
    assert [str(f) for f in scan_file(tmp_path / name, name)] == [finding]


def test_variable_values_are_found_encoded_too(tmp_path):
    (tmp_path / "env.b64").write_bytes(base64.b64encode(b"MY_DB_PASSWORD=correct-horse-battery\n"))
    (tmp_path / "env.gz").write_bytes(gzip.compress(b"pw correct-horse-battery"))
    assert find_secrets(tmp_path, {"MY_DB_PASSWORD": "correct-horse-battery"}) == [
        "env.b64:1: MY_DB_PASSWORD (in base64)", "env.gz:1: MY_DB_PASSWORD (in gzip)"]


def test_a_decompression_bomb_is_reported_not_passed(tmp_path, monkeypatch):
    monkeypatch.setattr(secret_forms, "MAX_EXPANDED", 1 << 20)
    (tmp_path / "bomb.gz").write_bytes(gzip.compress(b"\0" * (4 << 20)))
    (tmp_path / "small.gz").write_bytes(gzip.compress(b"\0" * (1 << 19)))
    assert find_secrets(tmp_path, {}) == ["bomb.gz: decoded content over 1 MiB, not scanned in full"]


def test_package_refuses_credentials_by_name_and_form(credential_run, tmp_path, capsys):
    import shutil

    _, run = credential_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for name in (".git-credentials", ".npmrc", ".pypirc", "server.ppk", ".hf_token"):
        (copy / name).write_text("nothing secret-shaped inside\n")
    for name, (content, _) in FORMS.items():
        (copy / name).write_bytes(content)
    for place in (".docker/config.json", "home/.kube/config"):  # login stores, known by their place
        (copy / place).parent.mkdir(parents=True)
        (copy / place).write_text('{"auths": {"registry.example": {"auth": "dXNlcjpwYXNz"}}}\n')
    out = tmp_path / "run.tar.gz"
    assert cli.main(["package", str(copy), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    missing = [f for f in [f"{name}: credentials file" for name in (".git-credentials", ".npmrc", ".pypirc",
                                                                      "server.ppk", ".hf_token",
                                                                      ".docker/config.json", "home/.kube/config")]
               + [finding for _, finding in FORMS.values()] if f not in err]
    assert not missing and not out.exists()
