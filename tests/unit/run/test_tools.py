"""Tests of rlrunbook.run.tools: run summary tables, packaging with a checksum manifest, secret scans.

Runs are written through ``RunWriter`` as the training loop writes them; malformed ones are made by
breaking a file afterwards. Expected table values are read off the rows written here by hand.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.run import RunWriter
from rlrunbook.run.tools import (
    COLUMNS,
    MANIFEST_FILE,
    _scan,
    find_secrets,
    format_table,
    package_run,
    summarize_runs,
    verify_package,
    write_table,
)

# DB_PASSWORD is not ASCII: JSON files write it escaped, and the scan must still find it.
SECRETS = {"MY_API_KEY": "sk-live-0123456789", "HF_TOKEN": "hf_abcdefghijkl", "DB_PASSWORD": "hunter2-pässwd"}


def make_run(root: Path, name: str, rewards: list[float], task: bool = True, environ: dict | None = None,
             config_extra: dict | None = None, argv: list[str] | None = None) -> Path:
    """A completed single-turn qa run with one train-log row, step file and rollout file per reward."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    writer = RunWriter(run_dir, environ=environ or {})
    config = {"mode": "single_turn", "env": "qa", "model": "tiny", "steps": len(rewards), "seed": 7,
              **(config_extra or {})}
    writer.write_metadata(config, {"steps": "cli"}, argv or ["rlrunbook", "train"],
                          {"name": "test", "rows": 8, "fingerprint": "f1ngerpr1nt"})
    for step, reward in enumerate(rewards):
        row = {"step": step, "reward/mean": reward, "loss/sum": 1.0 - step, "num_trained_tokens": 10 + step,
               "time/step_s": 0.5 * (step + 1)}
        writer.log_step({**row, "task_reward/mean": reward / 2} if task else row)
        writer.write_step(step, {"loss_fn": "importance_sampling", "training_data": [],
                                 "results": {"metrics": {"loss:sum": 1.0 - step}},
                                 "num_trained_tokens": 10 + step})
        records = [{"completion_text": f"answer {step}"}]
        writer.write_rollouts("baseline", step, {"env": "qa", "records": records})
    writer.finish("completed")
    return run_dir


def files_of(directory: Path) -> dict[str, bytes]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in files}


# --- summarize ---------------------------------------------------------------------------------------


def test_summary_rows_hold_the_runs_numbers(tmp_path):
    a = make_run(tmp_path, "run_a", [0.2, 0.6, 0.4])
    b = make_run(tmp_path, "run_b", [0.1], task=False)
    row_a, row_b = summarize_runs([a, b])
    assert list(row_a) == list(COLUMNS)
    assert row_a["run"] == "run_a" and row_a["status"] == "completed"
    assert (row_a["mode"], row_a["env"], row_a["model"], row_a["seed"], row_a["steps"]) == (
        "single_turn", "qa", "tiny", 7, 3)
    assert row_a["steps_logged"] == 3
    assert (row_a["reward_first"], row_a["reward_last"]) == (0.2, 0.4)
    task = (row_a["task_reward_first"], row_a["task_reward_last"], row_a["task_reward_best"])
    assert task == (0.1, 0.2, 0.3)  # halves of the rewards; best is step 1
    assert row_a["loss_last"] == -1.0  # 1.0 - step 2
    assert row_a["trained_tokens"] == 33  # 10 + 11 + 12
    assert row_a["step_time_mean_s"] == pytest.approx(1.0)  # (0.5 + 1.0 + 1.5) / 3
    assert row_a["dataset_fingerprint"] == "f1ngerpr1nt"
    assert row_a["started_at"] and row_a["finished_at"] and row_a["problems"] is None
    assert row_b["task_reward_best"] is None and row_b["task_reward_first"] is None
    assert row_b["reward_first"] == row_b["reward_last"] == 0.1


def test_malformed_run_dirs_become_rows_with_the_reason(tmp_path):
    broken = make_run(tmp_path, "broken", [0.5])
    (broken / "run_metadata.json").write_text('{"status": "comp')
    truncated = make_run(tmp_path, "truncated", [0.5, 0.7])
    with open(truncated / "train_log.jsonl", "a") as handle:
        handle.write('{"step": 2, "reward/me')  # a run killed mid-line
    empty = tmp_path / "empty"
    empty.mkdir()
    rows = summarize_runs([broken, truncated, empty, tmp_path / "absent"])
    assert [r["status"] for r in rows] == ["unreadable", "completed", "unreadable", "unreadable"]
    assert "run_metadata.json: invalid JSON" in rows[0]["problems"]
    assert rows[1]["steps_logged"] == 2 and "train_log.jsonl line 3: invalid JSON" in rows[1]["problems"]
    assert "run_metadata.json: missing" in rows[2]["problems"]
    assert "run_metadata.json: missing" in rows[3]["problems"]
    assert rows[0]["reward_first"] is None  # nothing guessed for an unreadable run


def test_tables_have_stable_columns_and_full_precision(tmp_path):
    rows = summarize_runs([make_run(tmp_path, "run_a", [0.1 + 0.2]), tmp_path / "absent"])
    rows[0]["custom"] = 1
    write_table(rows, tmp_path / "t.csv")
    read = list(csv.DictReader((tmp_path / "t.csv").open()))
    with (tmp_path / "t.csv").open() as handle:
        assert next(csv.reader(handle)) == [*COLUMNS, "custom"]
    assert float(read[0]["reward_first"]) == 0.1 + 0.2  # repr keeps every digit
    assert read[1]["status"] == "unreadable" and read[1]["reward_first"] == "" and read[1]["custom"] == ""
    write_table(rows, tmp_path / "t.tsv")
    assert (tmp_path / "t.tsv").read_text().splitlines()[0].split("\t")[:3] == ["run", "status", "mode"]
    markdown = write_table(rows, tmp_path / "t.md").read_text().splitlines()
    assert markdown[0].startswith("| run | status |") and set(markdown[1]) <= set("|- ")
    assert "| run_a | completed |" in markdown[2] and "0.3 |" in markdown[2]
    with pytest.raises(ConfigError, match=r"'\.xlsx'.*\.csv, \.tsv or \.md"):
        write_table(rows, tmp_path / "t.xlsx")


def test_format_table_aligns_columns(tmp_path):
    rows = summarize_runs([make_run(tmp_path, "a_long_run_name", [0.25]), tmp_path / "x"])
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:6] == ["run", "status", "mode", "env", "model", "steps_logged"]
    header = lines[0].split()
    first = dict(zip(header, lines[1].split(), strict=True))
    assert first["run"] == "a_long_run_name" and first["status"] == "completed" and first["reward_first"] == "0.25"
    assert first["problems"] == "none"  # nothing found wrong reads as such, not as a dash
    assert lines[2].split()[:3] == ["x", "unreadable", "-"]
    assert lines[1].index("completed") == lines[2].index("unreadable") == lines[0].index("status")


# --- package ----------------------------------------------------------------------------------------


def test_package_writes_manifest_and_verifies(tmp_path):
    run_dir = make_run(tmp_path / "logs", "run_a", [0.5, 0.6])
    (run_dir / "sub").mkdir()
    (run_dir / "sub" / "notes.txt").write_text("kept\n")
    (run_dir / ".train_log.jsonl.abc.tmp").write_text("half-written")  # a writer's temp file
    before = files_of(run_dir)
    archive = package_run(run_dir)
    assert archive == tmp_path / "logs" / "run_a.tar.gz" and archive.is_file()
    assert files_of(run_dir) == before  # the input is not touched: no manifest written into it
    assert not list(archive.parent.glob(".*.tmp"))
    with tarfile.open(archive) as tar:
        manifest = tar.extractfile(f"run_a/{MANIFEST_FILE}").read().decode()
        names = tar.getnames()
    expected = {rel: data for rel, data in before.items() if not rel.endswith(".tmp")}
    assert manifest.splitlines() == [
        f"{hashlib.sha256(data).hexdigest()}  {len(data)}  {rel}" for rel, data in sorted(expected.items())]
    assert "run_a/.train_log.jsonl.abc.tmp" not in names and "run_a/sub/notes.txt" in names
    assert verify_package(archive) == []


def _repack(archive: Path, out: Path, change) -> Path:
    """Copy ``archive`` to ``out`` member by member, letting ``change(name, data)`` edit or drop files."""
    with tarfile.open(archive) as src, tarfile.open(out, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if data is not None:
                data = change(member.name, data)
                if data is None:
                    continue
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    return out


def test_verify_reports_tampering(tmp_path):
    archive = package_run(make_run(tmp_path, "run_a", [0.5, 0.6]))

    def tamper(name: str, data: bytes) -> bytes | None:
        if name.endswith("train_log.jsonl"):
            return data.replace(b'"reward/mean": 0.5', b'"reward/mean": 0.9')  # same size, other bytes
        if name.endswith("baseline_1.json"):
            return data + b" "
        return None if name.endswith("training_step_0.json") else data

    problems = verify_package(_repack(archive, tmp_path / "tampered.tar.gz", tamper))
    assert "train_log.jsonl: sha256 differs from the manifest (modified after packaging)" in problems
    assert any(p.startswith("baseline_1.json: size") for p in problems)
    assert "training_step_0.json: listed in the manifest but missing from the archive" in problems
    assert len(problems) == 4  # baseline_1.json fails size and sha256

    with tarfile.open(tmp_path / "extra.tar.gz", "w:gz") as tar:
        with tarfile.open(archive) as src:
            for member in src.getmembers():
                tar.addfile(member, src.extractfile(member) if member.isfile() else None)
        info = tarfile.TarInfo("run_a/planted.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    extra = verify_package(tmp_path / "extra.tar.gz")
    assert extra == ["planted.txt: in the archive but not in the manifest"]


def test_verify_refuses_unsafe_or_unreadable_archives(tmp_path):
    (tmp_path / "garbage.tar.gz").write_bytes(b"not a tar")
    assert "cannot be read as a .tar.gz" in verify_package(tmp_path / "garbage.tar.gz")[0]
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        link = tarfile.TarInfo("run/escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    assert verify_package(tmp_path / "evil.tar.gz") == [
        "run/escape: unsafe member (link, device, absolute or '..' path)"]


def test_package_refuses_overwrite_and_skips_symlinks(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the run")
    run_dir = make_run(tmp_path, "run_a", [0.5])
    (run_dir / "link.txt").symlink_to(outside)
    with pytest.warns(UserWarning, match="link.txt: a symlink"):
        archive = package_run(run_dir, out=tmp_path / "out" / "a.tar.gz")
    with tarfile.open(archive) as tar:
        assert "run_a/link.txt" not in tar.getnames()
    first = archive.read_bytes()
    with pytest.raises(ConfigError, match=r"already exists.*overwrite"):  # refused before any file is read
        package_run(run_dir, out=archive)
    assert archive.read_bytes() == first
    (run_dir / "late.txt").write_text("added later")
    with pytest.warns(UserWarning):
        package_run(run_dir, out=archive, overwrite=True)
    with tarfile.open(archive) as tar:
        assert "run_a/late.txt" in tar.getnames()
    assert verify_package(archive) == []
    with pytest.raises(ConfigError, match="inside the run directory"):
        package_run(run_dir, out=run_dir / "self.tar.gz")
    with pytest.raises(InputError, match="does not exist"):
        package_run(tmp_path / "absent")


# --- secrets ----------------------------------------------------------------------------------------


def test_writer_redacts_secrets_and_scan_finds_planted_ones(tmp_path):
    environ = {**SECRETS, "SHORT_TOKEN": "abc", "PATH": "/usr/bin/not-secret"}
    run_dir = make_run(
        tmp_path, "run_a", [0.5], environ=environ,
        config_extra={"hub_token": SECRETS["HF_TOKEN"], "note": f"db {SECRETS['DB_PASSWORD']}"},
        argv=["rlrunbook", "train", "--api-key", SECRETS["MY_API_KEY"],
              f"--comment=uses {SECRETS['HF_TOKEN']}"],
    )
    metadata = (run_dir / "run_metadata.json").read_text()
    assert "<redacted>" in metadata  # the values were there to redact
    assert find_secrets(run_dir, environ) == []

    (run_dir / "notes.txt").write_text(f"pw {SECRETS['DB_PASSWORD']}, abc, /usr/bin/not-secret")
    (run_dir / "escaped.json").write_text(json.dumps({"k": SECRETS["DB_PASSWORD"], "t": SECRETS["HF_TOKEN"]}))
    (run_dir / "keys").mkdir()
    for name in (".netrc", "id_rsa.pub", "server.PEM", "credentials"):
        (run_dir / "keys" / name).write_text("x")
    lowercase = {name.lower(): value for name, value in SECRETS.items()}  # names match in any case
    findings = find_secrets(run_dir, lowercase)
    assert findings == [
        "escaped.json: db_password", "escaped.json: hf_token",  # JSON wrote "ä" as \u00e4
        "keys/.netrc: credentials file", "keys/credentials: credentials file",
        "keys/id_rsa.pub: credentials file", "keys/server.PEM: credentials file",
        "notes.txt: db_password",
    ]
    assert not any(value in finding for finding in findings for value in SECRETS.values())


def test_scan_finds_values_across_chunk_boundaries(tmp_path):
    value = b"sk-live-0123456789"
    for offset in range(40):
        path = tmp_path / f"f{offset}"
        path.write_bytes(b"x" * offset + value + b"y" * 7)
        assert _scan(path, {"MY_API_KEY": {value}}, chunk=16) == {"MY_API_KEY"}, offset
