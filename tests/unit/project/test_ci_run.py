"""``.ci/run`` is the newcomer: the README's test command in a lone clone of the commit, with a fresh HOME; then
the real-data tests with the data required, then the vLLM tier.

The command is read from the README (its "two commands" block), so a README that changes it fails here until
CI runs the new one. The clone and the newcomer's environment are the script's own functions, run here on a
scratch repository (sourcing ``.ci/run`` defines them and runs nothing).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from shell_words import simple_commands

ROOT = Path(__file__).resolve().parents[3]
CI_RUN = ROOT / ".ci" / "run"
GIT = ["git", "-c", "user.name=ci-test", "-c", "user.email=ci-test@example.invalid", "-c", "commit.gpgsign=false"]


def readme_test_command() -> list[str]:
    """The words of the README's test command: the ``bash scripts/test.sh`` line of its "two commands" block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"^## The two commands\n.*?^```bash\n(.*?)^```", readme, flags=re.MULTILINE | re.DOTALL)
    (line,) = [line for line in block.splitlines() if "scripts/test.sh" in line]
    return shlex.split(line, comments=True)


def _function(name: str) -> str:
    """The body of shell function ``name`` in .ci/run (``name() (`` or ``name() {`` up to the closing line)."""
    text = CI_RUN.read_text(encoding="utf-8")
    (body,) = re.findall(rf"^{name}\(\) [({{]\n(.*?)^[)}}]$", text, flags=re.MULTILINE | re.DOTALL)
    return body


def _runs(body: str, command: list[str]) -> bool:
    """Whether some command of ``body`` runs ``command`` (its words in order, with arguments after them)."""
    n = len(command)
    return any(words[i:i + n] == command for words in simple_commands(body, keep_assignments=True) for i in range(len(words) - n + 1))


def test_the_lone_clone_part_runs_the_readme_test_command_as_a_newcomer():
    assert readme_test_command()[:2] == ["bash", "scripts/test.sh"], "the README block was not read"
    body = _function("part_lone_clone")
    assert _runs(body, ["lone_clone", "$repo", "$work/clone"]) and _runs(body, ["cd", "$work/clone/rlrunbook"])
    assert _runs(body, ["as_newcomer", "$work/home", *readme_test_command()]), body
    assert body.index("lone_clone") < body.index("cd ") < body.index("as_newcomer")


def test_the_slow_tier_runs_in_the_same_lone_clone_and_home():
    body = _function("part_slow_tier")
    assert _runs(body, ["cd", "$work/clone/rlrunbook"]), body
    assert _runs(body, ["as_newcomer", "$work/home", *readme_test_command(), "-m", "slow and not long"]), body
    main = _function("main")
    assert main.index("part_lone_clone") < main.index("part_slow_tier") < main.index("part_real_data")


def test_the_real_data_and_vllm_parts_require_what_they_test():
    data = _function("part_real_data")
    assert _runs(data, ["RLRUNBOOK_REQUIRE_DATA=1", *readme_test_command(), "-m", "data"]), data
    vllm = _function("part_vllm")
    assert _runs(vllm, ["bash", "scripts/setup-vllm.sh"])
    assert _runs(vllm, ["RLRUNBOOK_REQUIRE_VLLM=1", *readme_test_command(), "-m", "vllm"]), vllm
    main = _function("main")
    order = [main.index(f"{name}\n") if f"{name}\n" in main else main.index(f"{name} ")
             for name in ("part_lone_clone", "part_real_data", "part_vllm")]
    assert order == sorted(order), "lone clone, then real data, then vLLM"


def test_the_script_parses_and_is_executable():
    assert os.access(CI_RUN, os.X_OK)
    subprocess.run(["bash", "-n", str(CI_RUN)], check=True)


def _source_and_call(*words: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = f"source {shlex.quote(str(CI_RUN))} && " + " ".join(map(shlex.quote, words))
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def scratch_repo(tmp_path) -> Path:
    """A repository with two commits (file.txt: "first", then "second") and an uncommitted change."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "file.txt").write_text("first\n")
    _git(repo, "add", "file.txt")
    _git(repo, "commit", "-qm", "first")
    (repo / "file.txt").write_text("second\n")
    _git(repo, "commit", "-qam", "second")
    (repo / "file.txt").write_text("uncommitted\n")
    return repo


def test_the_clone_is_the_commit_at_head_with_nothing_beside_it(scratch_repo, tmp_path):
    dest = tmp_path / "ci" / "clone"
    done = _source_and_call("lone_clone", str(scratch_repo), str(dest))
    assert done.returncode == 0, done.stderr
    assert os.listdir(dest) == ["rlrunbook"], "nothing beside the clone: no ../shared"
    clone = dest / "rlrunbook"
    assert _git(clone, "rev-parse", "HEAD") == _git(scratch_repo, "rev-parse", "HEAD")
    assert (clone / "file.txt").read_text() == "second\n", "the commit, without the uncommitted change"
    # A detached HEAD (as a CI checkout of a pull request often is) is the commit cloned, not the branch's tip.
    _git(scratch_repo, "checkout", "-q", "-f", "--detach", "HEAD~1")
    again = tmp_path / "ci" / "again"
    assert _source_and_call("lone_clone", str(scratch_repo), str(again)).returncode == 0
    assert (again / "rlrunbook" / "file.txt").read_text() == "first\n"


def test_the_newcomer_has_a_fresh_home_and_none_of_the_projects_variables(tmp_path):
    real_home, fresh = tmp_path / "real-home", tmp_path / "fresh-home"
    (real_home / ".config" / "pip").mkdir(parents=True)
    (real_home / ".config" / "pip" / "pip.conf").write_text("[global]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(real_home), "KEPT": "1", "RLRUNBOOK_DATA_DIR": "/data",
           "RLRUNBOOK_CACHE_DIR": "/cache", "HF_HOME": "/hf", "HF_ENDPOINT": "http://hub", "XDG_CACHE_HOME": "/xdg",
           "TINKER_BACKEND": "api", "TRANSFORMERS_CACHE": "/tc", "VIRTUAL_ENV": "/venv", "PYTHONPATH": "/src"}
    done = _source_and_call("as_newcomer", str(fresh), "env", env=env)
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert seen["HOME"] == str(fresh) and fresh.is_dir() and not any(fresh.iterdir())
    assert seen["KEPT"] == "1" and seen["PATH"] == os.environ["PATH"]
    leaked = sorted(name for name in seen
                    if name.startswith(("RLRUNBOOK_", "HF_", "XDG_", "TINKER_", "TRANSFORMERS_"))
                    or name in ("VIRTUAL_ENV", "PYTHONPATH"))
    assert leaked == []
    # pip keeps the machine's download cache and configuration
    assert seen["PIP_CACHE_DIR"] == str(real_home / ".cache" / "pip")
    assert seen["PIP_CONFIG_FILE"] == str(real_home / ".config" / "pip" / "pip.conf")
