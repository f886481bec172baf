"""tinker-cookbook recipes over the wire: unmodified, from processes that never import rlrunbook (only
``TINKER_BASE_URL`` and ``TINKER_API_KEY`` set), two at once against one ``rlrunbook serve``; each run's per-step
losses, rewards and token counts and every token it sampled equal those of the same recipe run in process
(``rlrunbook cookbook``), bit for bit. The model is the built-in ``tiny-thinking``, named by its folder (so the
recipe's own tokenizer loader finds it offline); math_rl needs no data, chat_sl reads the cookbook's bundled
example conversations.

Compared to a tolerance, not to the bit: the sampler's logprobs and what math_rl computes from them (its
importance-sampling loss and gradient norm, ``optim/kl_sample_train_*``, ``optim/entropy``). With another
client's calls in between, the server batches a recipe's sample requests differently from the run in process,
and on some CPUs (an Intel Xeon here) a row's logprobs then differ in the last bit with the number of rows in
the batch; the tokens drawn stay the same. Every process runs one intra-op thread: with two, on that CPU, about
one process in twelve rounds the losses' last bit differently from the others, in process as over the wire
(docs/serve.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from rlrunbook.backend.sample_log import compute_logprobs_probe, read_sample_log
from rlrunbook.models import resolve_model
from rlrunbook.testing.commands import installed_rlrunbook
from rlrunbook.testing.serve import start_server

pytestmark = [pytest.mark.e2e, pytest.mark.cookbook, pytest.mark.slow]

KEY = "tml-cookbook-over-the-wire"
MATH_RL = "tinker_cookbook.recipes.math_rl.train"
CHAT_SL = "tinker_cookbook.recipes.chat_sl.train"
IMPORTED = re.compile(r"\| +rlrunbook(\.|$)", re.M)  # a line of python -X importtime naming rlrunbook


def _recipes(model: Path) -> dict[str, list[str]]:
    conversations = Path(str(resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"))
    common = [f"model_name={model}", "renderer_name=qwen3_5", "behavior_if_log_dir_exists=delete", "max_steps=2"]
    return {
        MATH_RL: [*common, "groups_per_batch=4", "group_size=4", "max_tokens=24", "loss_fn=importance_sampling",
                  "eval_every=0"],
        CHAT_SL: [*common, f"dataset={conversations}", "batch_size=16", "max_length=256", "eval_every=0",
                  "infrequent_eval_every=0"],
    }


# What math_rl computes from the sampler's logprobs (chat_sl samples nothing, so its numbers are all compared exactly)
SAMPLER_METRICS = ("optim/kl_sample_train", "optim/entropy", "loss:sum", "grad_norm:mean")


def _clean_env(home: Path) -> dict[str, str]:
    """This environment without the project's, the backend's or the SDK's variables; offline; a home of its own;
    one intra-op thread (see the module docstring)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TINKER_", "RLRUNBOOK_", "HF_")) and k != "PYTHONPATH"}
    return {**env, "HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RLRUNBOOK_CACHE_DIR": os.environ.get(
                "RLRUNBOOK_CACHE_DIR") or str(Path.home() / ".cache" / "rlrunbook")}


def _metrics(log: Path, sampler: bool = False, samples: bool = True) -> list[dict]:
    """Each step's metrics but its timings: for a recipe that ``samples``, those computed from the sampler's
    logprobs (``sampler``), or all the others."""
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    split = SAMPLER_METRICS if samples else ()
    return [{k: v for k, v in row.items() if not k.startswith("time/") and k.startswith(split) == sampler}
            for row in rows]


def _differences(got: list[dict], want: list[dict]) -> list[tuple]:
    """(step, metric, got, want) of every metric that differs, the first ten."""
    found = [(index, key, row.get(key), other.get(key)) for index, (row, other) in enumerate(zip(got, want))
             for key in sorted(row.keys() | other.keys()) if row.get(key) != other.get(key)]
    return found[:10] + ([f"... {len(got)} and {len(want)} rows"] if len(got) != len(want) else [])


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> dict[str, Path]:
    """Each recipe run alone in process (``rlrunbook cookbook``): its folder, with ``log/`` and ``samples.jsonl``."""
    model = resolve_model("tiny-thinking")
    runs = {}
    for module, args in _recipes(model).items():
        folder = tmp_path_factory.mktemp(module.split(".")[-2])
        env = {**_clean_env(folder / "home"), "TINKER_LOCAL_STORAGE": str(folder / "tinker"),
               "TINKER_LOCAL_DEVICE": "cpu", "TINKER_LOCAL_SAMPLE_LOG": str(folder / "samples.jsonl")}
        done = subprocess.run([installed_rlrunbook(), "cookbook", module, *args, f"log_path={folder / 'log'}"],
                              env=env, cwd=folder, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[module] = folder
    return runs


def test_two_recipes_at_once_over_the_wire_equal_their_runs_in_process(in_process, tmp_path):
    model = resolve_model("tiny-thinking")
    server = start_server(tmp_path / "storage", "--api-key", KEY,
                          env={**_clean_env(tmp_path / "server-home"), "TINKER_LOCAL_DEVICE": "cpu",
                               "TINKER_LOCAL_SAMPLE_LOG": str(tmp_path / "samples.jsonl")})
    try:
        processes = {}
        for module, args in _recipes(model).items():
            folder = tmp_path / module.split(".")[-2]
            folder.mkdir()
            env = {**_clean_env(folder / "home"), "TINKER_BASE_URL": server.url, "TINKER_API_KEY": KEY}
            command = [sys.executable, "-X", "importtime", "-m", module, *args, f"log_path={folder / 'log'}"]
            processes[module] = (folder, subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.PIPE,
                                                          stderr=subprocess.PIPE, text=True))
        for module, (folder, process) in processes.items():
            _, stderr = process.communicate(timeout=900)
            assert process.returncode == 0, f"{module}: {stderr[-4000:]}"
            assert not IMPORTED.search(stderr), f"{module} imported rlrunbook"
            # The wire adds nothing: the same losses, rewards, token counts and gradient norms, step by step.
            log, alone, samples = folder / "log", in_process[module] / "log", module == MATH_RL
            wire, here = _metrics(log, samples=samples), _metrics(alone, samples=samples)
            assert len(wire) >= 2 and wire == here, (module, _differences(wire, here))
            for got, want in zip(_metrics(log, True, samples), _metrics(alone, True, samples), strict=True):
                assert got.keys() == want.keys(), (got, want)
                assert all(abs(got[k] - want[k]) <= 1e-6 + 1e-5 * abs(want[k]) for k in got), (got, want)
        assert all(row["train_mean_nll"] > 0 for row in _metrics(processes[CHAT_SL][0] / "log"))
        assert any(row.get("loss:sum", 0) != 0 for row in _metrics(processes[MATH_RL][0] / "log", True))  # it trained
    finally:
        server.stop()
    assert KEY not in server.output
    # Every token sampled (math_rl's rollouts; chat_sl samples nothing) is the in-process run's, with its logprobs.
    # The SDK sends compute_logprobs as a one-token sample, which only the server records.
    sampled = _by_seed([line for line in read_sample_log(tmp_path / "samples.jsonl")
                        if not compute_logprobs_probe(line)])
    expected = _by_seed(read_sample_log(in_process[MATH_RL] / "samples.jsonl"))
    assert len(expected) == 2 * 4 * 4  # 2 steps x 4 groups x 4 samples, a request per sample
    assert sampled.keys() == expected.keys()
    for seed, line in expected.items():
        got = sampled[seed]
        assert got["prompt"] == line["prompt"]
        assert [s["tokens"] for s in got["sequences"]] == [s["tokens"] for s in line["sequences"]]
        for a, b in zip(got["sequences"], line["sequences"]):
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-5


def _by_seed(lines: list[dict]) -> dict[int, dict]:
    found = {line["seed"]: line for line in lines}
    assert len(found) == len(lines), "two requests drew the same seed"
    return found


TRAIN = ["--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "8", "--num-groups", "2", "-s", "2"]
NOT_NUMBERS = ("time/", "throughput/", "memory/", "engine/")  # timings, and the in-process engine's own counters


def _train_log(root: Path) -> list[dict]:
    (run,) = root.iterdir()
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(NOT_NUMBERS)} for row in rows]


def test_train_through_the_service_equals_train_in_process(tmp_path):
    """``rlrunbook train --service URL`` runs the project's own loop through a running server: it passes its
    rubric, and every step's numbers (rewards, advantages, loss, gradient norm, sampler-trainer mismatch) are
    those of the same command in process."""
    env = {**_clean_env(tmp_path / "home"), "TINKER_LOCAL_DEVICE": "cpu"}
    server = start_server(tmp_path / "storage", "--api-key", KEY, env=env)
    try:
        over = subprocess.run([installed_rlrunbook(), "train", "--service", server.url, *TRAIN,
                               "--log-root", str(tmp_path / "service")], env={**env, "TINKER_API_KEY": KEY},
                              cwd=tmp_path, capture_output=True, text=True, timeout=900)
    finally:
        server.stop()
    assert over.returncode == 0, over.stdout[-3000:] + over.stderr[-3000:]
    assert f"the Tinker service at {server.url} (TINKER_BACKEND=api)" in over.stdout  # not in process
    here = subprocess.run([installed_rlrunbook(), "train", *TRAIN, "--log-root", str(tmp_path / "local")],
                          env={**env, "TINKER_LOCAL_STORAGE": str(tmp_path / "tinker")}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert here.returncode == 0, here.stderr[-3000:]
    wire, local = _train_log(tmp_path / "service"), _train_log(tmp_path / "local")
    assert len(wire) == 2 and wire == local, _differences(wire, local)
    assert all(row["loss/sum"] != 0 or row["grad_norm"] > 0 for row in wire)
