"""Case tables of the hostile-input run, part two: files and folders, and what is written to them.

One function per class, each adding its cases in order through ``add``: ``filesystem`` (paths that are files,
unwritable or special), ``model_folders`` (a broken copy of the tiny model), ``yaml_configs`` (odd YAML),
``resume`` (a prepared run with one file corrupted), ``overwrites`` (``--out`` into a prepared run's own files)
and ``secrets`` (secret values that must reach no written file, path or package archive). Nothing runs here.
"""

from __future__ import annotations

import base64
import gzip
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from .case import (
    EVAL,
    EVAL_CK,
    TQA,
    Add,
    Case,
    Ctx,
    T,
    archive_has,
    edit_json,
    lr_trusted_check,
    make_immutable,
    qa_rows,
    readonly_dir,
    w,
    yaml_case,
)


def filesystem(add: Add) -> None:
    """File-system states: storage, cache, log and output paths that are files, unwritable or special."""
    def file_at(rel: str) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            p = ctx.root / rel
            if p.is_dir():
                shutil.rmtree(p)
            w(p, "not a directory\n")
        return setup

    def ro_at(rel: str, keep_cache: bool = True) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            readonly_dir(ctx.root / rel)
        return setup

    add("filesystem",
        Case("storage-is-file", "", TQA, env={"TINKER_LOCAL_STORAGE": "{root}/storefile"},
             setup=file_at("storefile")),
        Case("storage-readonly", "", TQA, env={"TINKER_LOCAL_STORAGE": "{root}/rostore"}, setup=ro_at("rostore")),
        Case("storage-under-file", "", TQA, env={"TINKER_LOCAL_STORAGE": "{root}/storefile/sub"},
             setup=file_at("storefile")),
        Case("cache-is-file", "", TQA, env={"RLRUNBOOK_CACHE_DIR": "{root}/cachefile"}, setup=file_at("cachefile")),
        Case("cache-readonly-empty", "", TQA, env={"RLRUNBOOK_CACHE_DIR": "{root}/rocache"},
             setup=ro_at("rocache")),
        Case("cache-under-file", "", TQA, env={"RLRUNBOOK_CACHE_DIR": "{root}/cachefile/sub"},
             setup=file_at("cachefile")),
        Case("cache-readonly-dataset-cache", "", TQA + ["--cache-dataset"],
             setup=lambda c: readonly_dir(c.cache / "datasets")),
        Case("cache-models-is-file", "", TQA, setup=lambda c: (shutil.rmtree(c.cache / "models", True),
                                                                w(c.cache / "models", "x"))),
        Case("log-root-readonly", "", TQA + ["--log-root", "{root}/rologs"], setup=ro_at("rologs")),
        Case("log-root-is-file", "", TQA + ["--log-root", "{root}/logfile"], setup=file_at("logfile")),
        Case("log-root-env-is-file", "", TQA, env={"RLRUNBOOK_LOG_ROOT": "{root}/logfile"},
             setup=file_at("logfile")),
        Case("cwd-readonly-default-logs", "", TQA, unset=("RLRUNBOOK_LOG_ROOT",),
             setup=lambda c: readonly_dir(c.work)),
        Case("home-is-file", "", TQA, env={"HOME": "{root}/homefile"}, unset=("XDG_CACHE_HOME", "MPLCONFIGDIR"),
             setup=file_at("homefile")),
        Case("tmpdir-readonly", "", TQA, env={"TMPDIR": "{root}/rotmp"}, setup=ro_at("rotmp"), stop_at_run=True),
        Case("package-out-readonly", "", ["package", "{run}", "--out", "{root}/roout/run.tar.gz"], needs_run=True,
             setup=ro_at("roout")),
        Case("package-out-parent-file", "", ["package", "{run}", "--out", "{root}/pfile/run.tar.gz"],
             needs_run=True, setup=file_at("pfile")),
        Case("package-out-is-dir", "", ["package", "{run}", "--out", "{work}"], needs_run=True),
        Case("package-run-readonly-default-out", "", ["package", "{run}"], needs_run=True,
             setup=lambda c: make_immutable(c.logs)),
        Case("eval-out-parent-file", "", EVAL + ["--out", "{root}/pfile/e.json"], setup=file_at("pfile")),
        Case("eval-out-readonly", "", EVAL + ["--out", "{root}/roout/e.json"], setup=ro_at("roout")),
        Case("eval-out-is-dir", "", EVAL + ["--out", "{work}"]),
        Case("summarize-out-parent-file", "", ["summarize", "{run}", "--out", "{root}/pfile/t.csv"],
             needs_run=True, setup=file_at("pfile")),
        Case("summarize-out-readonly", "", ["summarize", "{run}", "--out", "{root}/roout/t.md"], needs_run=True,
             setup=ro_at("roout")),
        Case("summarize-out-bad-suffix", "", ["summarize", "{run}", "--out", "{work}/t.xlsx"], needs_run=True),
        Case("eval-checkpoints-out-parent-file", "", EVAL_CK + ["{run}", "--out", "{root}/pfile/t.csv"],
             needs_run=True, setup=file_at("pfile"), timeout=240),
        Case("check-run-missing", "", ["check-run", "{root}/nope"]),
        Case("check-run-a-file", "", ["check-run", "{root}/f"], setup=lambda c: w(c.root / "f", "x")),
        Case("summarize-unreadable-dir", "", ["summarize", "{root}/emptyrun"],
             setup=lambda c: (c.root / "emptyrun").mkdir()),
        Case("resume-from-missing", "", ["train", "--resume-from", "{root}/nope"]),
        Case("resume-from-a-file", "", ["train", "--resume-from", "{root}/f"], setup=lambda c: w(c.root / "f", "x")),
        Case("config-file-is-dir", "", ["train", "--config-file", "{work}", "--model", "tiny"]),
        Case("config-file-fifo", "", ["train", "--config-file", "{work}/fifo", "--model", "tiny"],
             setup=lambda c: os.mkfifo(c.work / "fifo"), timeout=60),
        Case("dataset-dev-zero", "", TQA[:6] + ["/dev/zero"] + TQA[7:], timeout=90),
        Case("dataset-is-fifo", "", TQA[:6] + ["{work}/fifo.jsonl"] + TQA[7:],
             setup=lambda c: os.mkfifo(c.work / "fifo.jsonl"), timeout=60),
        Case("dataset-dir-two-jsonl", "", TQA[:6] + ["{work}/d"] + TQA[7:],
             setup=lambda c: (w(c.work / "d/a.jsonl", qa_rows()), w(c.work / "d/b.jsonl", qa_rows()))),
        Case("storage-store-file-corrupt", "", ["eval", "--weights", "tinker://local-0000/sampler_weights/x"]
             + EVAL[3:]),
        )


def model_folders(add: Add) -> None:
    """Broken model folders: a copy of the built tiny model with one file broken, and the cached one."""
    def model_dir(mutate: Callable[[Path], None]) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            src = next((ctx.cache / "models").glob("tiny*"))
            dst = ctx.work / "m"
            shutil.copytree(src, dst)
            mutate(dst)
        return setup

    def hdr(n: int, body: bytes) -> bytes:
        return n.to_bytes(8, "little") + body

    broken = {
        "config-not-json": lambda d: w(d / "config.json", "{not json"),
        "config-empty": lambda d: w(d / "config.json", ""),
        "config-list": lambda d: w(d / "config.json", "[1, 2]"),
        "config-not-utf8": lambda d: w(d / "config.json", b'{"model_type": "\xff\xfe"}'),
        "config-unknown-model-type": lambda d: edit_json(d / "config.json", lambda c: c.update(model_type="nope")),
        "config-missing": lambda d: (d / "config.json").unlink(),
        "config-vocab-negative": lambda d: edit_json(d / "config.json", lambda c: c.update(vocab_size=-5)),
        "config-hidden-1e12": lambda d: edit_json(d / "config.json", lambda c: c.update(hidden_size=10 ** 12)),
        "safetensors-bad-header": lambda d: w(d / "model.safetensors", hdr(20, b"{not a json header!!")),
        "safetensors-huge-header-len": lambda d: w(d / "model.safetensors", hdr(2 ** 62, b"{}")),
        "safetensors-truncated": lambda d: w(d / "model.safetensors", (d / "model.safetensors").read_bytes()[:4096]),
        "safetensors-empty": lambda d: w(d / "model.safetensors", b""),
        "safetensors-missing": lambda d: (d / "model.safetensors").unlink(),
        "tokenizer-not-json": lambda d: w(d / "tokenizer.json", "{oops"),
        "tokenizer-missing": lambda d: (d / "tokenizer.json").unlink(),
        "tokenizer-config-not-json": lambda d: w(d / "tokenizer_config.json", "]["),
        "generation-config-not-json": lambda d: w(d / "generation_config.json", "nope"),
    }
    for name, mut in broken.items():
        add("model-folder", Case(f"model-{name}", "", ["train", "--model", "{work}/m"] + TQA[3:],
                                 setup=model_dir(mut), timeout=120))
    add("model-folder",
        Case("model-eval-config-not-json", "", ["eval", "--model", "{work}/m"] + EVAL[3:],
             setup=model_dir(broken["config-not-json"])),
        Case("model-eval-safetensors-bad", "", ["eval", "--model", "{work}/m"] + EVAL[3:],
             setup=model_dir(broken["safetensors-bad-header"])),
        Case("model-resolve-empty-dir", "", ["resolve-model", "{work}/m"], setup=lambda c: (c.work / "m").mkdir()),
        Case("model-check-logprobs-bad-header", "", ["check-logprobs", "--model", "{work}/m", "--max-tokens", "4",
                                                     "--num-samples", "1"],
             setup=model_dir(broken["safetensors-bad-header"])),
        Case("model-builtin-cache-corrupt", "", TQA,
             setup=lambda c: w(next((c.cache / "models").glob("tiny*")) / "config.json", "{broken")),
        Case("model-builtin-cache-safetensors-corrupt", "", TQA,
             setup=lambda c: w(next((c.cache / "models").glob("tiny*")) / "model.safetensors", hdr(9, b"{garbage}"))),
        )


def yaml_configs(add: Add) -> None:
    """YAML: sweeps with odd keys, alias bombs, tags, duplicates and values of the wrong type."""
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    ) + "extra:\n  bomb: *i\n"
    add("yaml",
        yaml_case("sweep-numeric-key", "sweep:\n  1: [a, b]\nsteps: 1\n"),
        yaml_case("sweep-null-key", "sweep:\n  ~: [1, 2]\n"),
        yaml_case("sweep-list-key", "sweep:\n  [a, b]: [1, 2]\n"),
        yaml_case("sweep-not-mapping", "sweep: 5\n"),
        yaml_case("alias-bomb", bomb, cmd="train"),
        yaml_case("alias-bomb-show-config", bomb, cmd="show-config"),
        yaml_case("alias-bomb-in-sweep", bomb.replace("extra:\n  bomb: *i\n", "sweep:\n  seed: *i\n"),
                  cmd="show-config"),
        yaml_case("yaml-top-level-list", "- 1\n- 2\n"),
        yaml_case("yaml-top-level-scalar", "hello\n"),
        yaml_case("yaml-empty", ""),
        yaml_case("yaml-python-tag", "name: !!python/object/apply:os.system ['true']\n"),
        yaml_case("yaml-binary-tag", "name: !!binary aGVsbG8=\n"),
        yaml_case("yaml-steps-true", "steps: true\nnum_rollouts: 4\nmax_tokens: 8\n", expect="refuse_or_warn",
                  stop_at_run=True, warn_words=("steps",)),
        yaml_case("yaml-seed-float", "seed: 1.5\n"),
        yaml_case("yaml-duplicate-key", "steps: 1\nsteps: 2\nnum_rollouts: 4\nmax_tokens: 8\n",
                  expect="refuse_or_warn", stop_at_run=True, warn_words=("steps", "duplicate")),
        yaml_case("yaml-deep-nesting", "extra: " + "[" * 5000 + "]" * 5000 + "\n"),
        yaml_case("yaml-huge-int", "seed: " + "9" * 5001 + "\n"),
        yaml_case("yaml-merge-key-loop", "a: &a\n  <<: *a\n"),
        yaml_case("yaml-tab-indent", "loss:\n\tkl_coef: 1\n"),
        yaml_case("yaml-unknown-top-key", "stepz: 3\n", expect="no_crash"),
        yaml_case("yaml-version-99", "version: 99\n"),
        yaml_case("yaml-sweep-empty-list", "sweep:\n  seed: []\n"),
        yaml_case("yaml-sweep-repeated-point", "sweep:\n  seed: [1, 1]\nsteps: 1\nnum_rollouts: 4\nmax_tokens: 8\n",
                  expect="refuse_or_warn", cmd="show-config", warn_words=("sweep", "repeat", "duplicate")),
        )


def resume(add: Add) -> None:
    """Resume with corrupted files: one file of the prepared run's checkpoints or records broken."""
    def corrupt(rel: str, fn: Callable[[Path], None]) -> Callable[[Ctx], None]:
        def setup(ctx: Ctx) -> None:
            fn(ctx.run / rel)
        return setup

    ck = "checkpoints/step_000001/"
    resume = {
        "checkpoint-json-not-json": (ck + "checkpoint.json", lambda p: w(p, "{oops")),
        "checkpoint-json-empty": (ck + "checkpoint.json", lambda p: w(p, "")),
        "checkpoint-json-no-has-optimizer": (ck + "checkpoint.json", lambda p: edit_json(
            p, lambda d: d.pop("has_optimizer"))),
        "checkpoint-json-no-config": (ck + "checkpoint.json", lambda p: edit_json(p, lambda d: d.pop("config"))),
        "checkpoint-json-step-string": (ck + "checkpoint.json", lambda p: edit_json(p, lambda d: d.update(step="x"))),
        "checkpoint-json-cursor-negative": (ck + "checkpoint.json", lambda p: edit_json(
            p, lambda d: d["data_cursor"].update(next_problem=-5))),
        "checkpoint-json-list": (ck + "checkpoint.json", lambda p: w(p, "[]")),
        "checkpoint-json-missing": (ck + "checkpoint.json", lambda p: p.unlink()),
        "rng-json-no-python": ("checkpoints/step_000002/rng.json", lambda p: edit_json(
            p, lambda d: d.pop("python", None))),
        "rng-json-not-json": ("checkpoints/step_000002/rng.json", lambda p: w(p, "nope")),
        "rng-json-bad-value": ("checkpoints/step_000002/rng.json", lambda p: edit_json(
            p, lambda d: d.update({k: "garbage" for k in list(d)}))),
        "rng-safetensors-truncated": ("checkpoints/step_000002/rng.safetensors", lambda p: w(p, p.read_bytes()[:50])),
        "adapter-truncated": ("checkpoints/step_000002/adapter.safetensors", lambda p: w(p, p.read_bytes()[:100])),
        "optimizer-garbage": ("checkpoints/step_000002/optimizer.pt", lambda p: w(p, b"not a torch file")),
        "run-metadata-truncated": ("run_metadata.json", lambda p: w(p, p.read_bytes()[: len(p.read_bytes()) // 2])),
        "run-metadata-empty": ("run_metadata.json", lambda p: w(p, "")),
        "run-metadata-not-utf8": ("run_metadata.json", lambda p: w(p, b"\xff\xfe" + p.read_bytes())),
        "train-log-garbage": ("train_log.jsonl", lambda p: w(p, b"\x00\xff garbage\n")),
    }
    for name, (rel, fn) in resume.items():
        target = "{ck2}" if "step_000002" in rel else ("{ck1}" if rel.startswith("checkpoints/step_000001")
                                                         else "{run}")
        add("resume", Case(f"resume-{name}", "", ["train", "--resume-from", target], needs_run=True,
                           setup=corrupt(rel, fn), timeout=240))
    add("resume",
        Case("resume-flipped-lr-digit", "", ["train", "--resume-from", "{ck1}"], needs_run=True, timeout=240,
             setup=corrupt(ck + "checkpoint.json", lambda p: w(p, p.read_text().replace(
                 '"learning_rate": 0.001,', '"learning_rate": 0.009,'))),
             post=lr_trusted_check, note="must refuse (checksum) or not use 0.009"),
        Case("resume-with-contradicting-override", "", ["train", "--resume-from", "{ck1}", "--model", "other"],
             needs_run=True),
        Case("resume-checkpoint-dir-is-file", "", ["train", "--resume-from", "{ck1}"], needs_run=True,
             setup=lambda c: (shutil.rmtree(c.run / "checkpoints/step_000001"),
                              w(c.run / "checkpoints/step_000001", "x"))),
        )


def overwrites(add: Add) -> None:
    """Overwrites: --out into a prepared run's own files; none of them may change."""
    add("overwrite",
        Case("eval-out-run-metadata", "", EVAL + ["--out", "{run}/run_metadata.json"], needs_run=True),
        Case("eval-out-checkpoint-json", "", EVAL + ["--out", "{ck1}/checkpoint.json"], needs_run=True),
        Case("eval-out-train-log", "", EVAL + ["--out", "{run}/train_log.jsonl"], needs_run=True),
        Case("eval-out-adapter", "", EVAL + ["--out", "{ck2}/adapter.safetensors"], needs_run=True),
        Case("summarize-out-run-metadata", "", ["summarize", "{run}", "--out", "{run}/run_metadata.json"],
             needs_run=True),
        # these three also list the prepared run in protect (as well as needs_run), so that it must stay untouched
        Case("summarize-out-train-log-csv", "", ["summarize", "{run}", "--out", "{run}/report.md"],
             needs_run=True, setup=lambda c: w(c.run / "report.md", "# kept\n"), protect=("{run}",)),
        Case("summarize-out-training-step", "", ["summarize", "{run}", "--out", "{run}/training_step_0.json"],
             needs_run=True),
        Case("package-out-run-metadata", "", ["package", "{run}", "--out", "{run}/run_metadata.json"],
             needs_run=True),
        Case("package-out-checkpoint", "", ["package", "{run}", "--out", "{ck1}/checkpoint.json", "--overwrite"],
             needs_run=True),
        Case("package-out-inside-run", "", ["package", "{run}", "--out", "{run}/run.tar.gz"], needs_run=True),
        Case("package-overwrite-run-file", "", ["package", "{run}", "--out", "{run}/train_log.jsonl",
                                                "--overwrite"], needs_run=True),
        Case("eval-checkpoints-out-run-metadata", "", EVAL_CK + ["{run}", "--out", "{run}/run_metadata.csv"],
             needs_run=True, setup=lambda c: w(c.run / "run_metadata.csv", "kept\n"), timeout=240,
             protect=("{run}",)),
        Case("eval-checkpoints-out-train-log", "", EVAL_CK + ["{run}", "--out", "{ck1}/checkpoint.md"],
             needs_run=True, setup=lambda c: w(c.run / "checkpoints/step_000001/checkpoint.md", "kept\n"),
             timeout=240, protect=("{run}",)),
        Case("eval-out-symlink-to-run", "", EVAL + ["--out", "{work}/link.json"], needs_run=True,
             setup=lambda c: os.symlink(c.run / "run_metadata.json", c.work / "link.json")),
        Case("train-log-root-is-run", "", TQA + ["--log-root", "{run}"], needs_run=True, stop_at_run=True),
        Case("resume-keeps-source", "", ["train", "--resume-from", "{ck1}"], needs_run=True, timeout=240),
        )


def secrets(add: Add) -> None:
    """Secrets: in options, the environment, YAML and files packaged with a run; none may be written."""
    sk = "sk-proj-" + "Ab3" * 12
    def sec(cid: str, argv: list, secret: str, **kw) -> Case:
        kw.setdefault("timeout", 240)
        return Case(cid, "", argv, secret=secret, **kw)

    add("secrets",
        sec("extra-openai-key", T + ["checkpoint.every=1", f"extra.openai_key={sk}"], sk),
        sec("extra-passphrase", TQA + ["--checkpoint-every", "1", "extra.passphrase=correct-horse-battery-9"],
            "correct-horse-battery-9"),
        sec("extra-note-with-sk", TQA + [f"extra.note=key is {sk}"], sk, stop_at_run=True),
        sec("name-with-secret", TQA + ["--name", f"run-{sk}"], sk, stop_at_run=True),
        sec("sweep-secret-in-name", TQA + ["--sweep", f"extra.api_key={sk},{sk}x"], sk, stop_at_run=True),
        sec("sweep-secret-other-key", TQA + ["--sweep", "extra.openai_key=sk-" + "Zz9" * 12 + ",x"],
            "sk-" + "Zz9" * 12, stop_at_run=True),
        sec("env-url-userinfo", TQA, "hunter2pass", env={"HTTPS_PROXY": "http://bob:hunter2pass@proxy.invalid:3128"},
            stop_at_run=True),
        sec("env-hf-endpoint-userinfo", TQA, "s3cr3tpw", env={"HF_ENDPOINT": "https://u:s3cr3tpw@hf.invalid"},
            stop_at_run=True),
        sec("env-vllm-url-userinfo", TQA, "vllmpw77", env={"TINKER_LOCAL_VLLM_URL": "http://a:vllmpw77@127.0.0.1:9"},
            stop_at_run=True),
        sec("dataset-url-userinfo", TQA[:6] + ["https://u:dspw9911@example.invalid/d.jsonl"] + TQA[7:], "dspw9911"),
        sec("yaml-github-token", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
            "ghp_" + "A1b2" * 9, setup=lambda c: w(c.work / "cfg.yaml", "steps: 1\nnum_rollouts: 4\nmax_tokens: 8\n"
                                                  "extra:\n  gh: ghp_" + "A1b2" * 9 + "\n"), stop_at_run=True),
        sec("blocklist-secret", TQA + ["--blocklist", sk], sk, stop_at_run=True),
        )
    pk = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
          "-----END OPENSSH PRIVATE KEY-----\n")
    pkg_files = {
        "git-credentials": (".git-credentials", "https://alice:ghp_" + "Q7w" * 12 + "@github.com\n"),
        "npmrc": (".npmrc", "//registry.npmjs.org/:_authToken=npm_" + "x9Y" * 12 + "\n"),
        "pypirc": (".pypirc", "[pypi]\nusername = __token__\npassword = pypi-AgEIcHlwaS5vcmc" + "Kq1" * 10 + "\n"),
        "putty-key": ("id_ed25519.ppk", "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nComment: k\n"
                      "Public-Lines: 1\nAAAAC3NzaC1lZDI1NTE5AAAAIG\nPrivate-Lines: 1\nAAAAIDx9\n"),
        "token-named-file": ("hf_token", "hf_" + "Kx7" * 12 + "\n"),
        "api-token-txt": ("api_token.txt", "tok_" + "9f8e" * 8 + "\n"),
        "slack-webhook": ("notes.txt", "hook: https://hooks.slack.com/services/T01ABCDEF/B02GHIJKL/"
                          + "Xy7" * 8 + "\n"),
        "aws-secret-key": ("aws.cfg", "[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCY"
                           + "EXAMPLEKEY\n"),
        "aws-credentials-file": (".aws/credentials", "[default]\naws_access_key_id = AKIA" + "ABCDEFGHIJKLMNOP"
                                 + "\naws_secret_access_key = " + "s" * 40 + "\n"),
        "netrc": (".netrc", "machine example.com login bob password hunter2\n"),
        "docker-config": (".docker/config.json", '{"auths": {"r.io": {"auth": "Ym9iOmh1bnRlcjI="}}}\n'),
        "private-key-plain": ("id_rsa", pk),
        "private-key-gzip": ("blob.gz", gzip.compress(pk.encode())),
        "private-key-base64": ("blob.b64", base64.b64encode(pk.encode()).decode() + "\n"),
        "private-key-utf16": ("blob16.txt", pk.encode("utf-16")),
        "sk-key-utf16": ("notes16.txt", ("key " + sk + "\n").encode("utf-16-le")),
        "sk-key-gzip": ("log.jsonl.gz", gzip.compress(('{"k": "' + sk + '"}\n').encode())),
        "sk-key-base64": ("cfg.b64", base64.b64encode(("OPENAI_API_KEY=" + sk).encode()).decode() + "\n"),
        "gcp-service-account": ("sa.json", '{"type": "service_account", "private_key_id": "abc", '
                                '"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIE\\n-----END PRIVATE KEY-----\\n"}'),
        "env-file": (".env", "OPENAI_API_KEY=" + sk + "\n"),
        "kube-config": (".kube/config", ("users:\n- name: u\n  user:\n"
                                         "    token: eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl\n")),
    }
    for name, (rel, body) in pkg_files.items():
        add("secrets", Case(f"package-{name}", "", ["package", "{run}", "--out", "{work}/run.tar.gz"],
                            needs_run=True, setup=lambda c, rel=rel, body=body: w(c.run / rel, body),
                            post=archive_has(re.escape(Path(rel).name) + "$")))
