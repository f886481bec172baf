"""Hostile input to every command: hypothesis writes argument vectors, config files and data lines, and each
example must end as docs/cli.md says a command ends.

The invariants, for every example:

- the exit code is 0, 1 or 2 (the documented codes; 130 and 143 are for signals, which no example sends);
- no traceback in the output, and no exception out of ``cli.main`` (a user would see a traceback);
- no file outside the output paths changed: every file of the example's sandbox (a run directory, a config
  file, a data file, ...) is as it was, except under the paths the command was told to write to (``--out``,
  ``--log-root``, ``--png``, ``data.cache_dir``, the default ``logs/`` and ``RUN_DIR.tar.gz``);
- bounded time: an example that runs past ``EXAMPLE_SECONDS`` fails.

The options come from the parser itself (every option of every subcommand, with values drawn by the option's
type: numbers from a pool of hostile numbers, paths from the sandbox's files, text with newlines and lone
surrogates), on top of a small valid command line, so that a drawn value meets the code behind the parser and
not only argparse. ``train`` and ``show-config`` also get ``key=value`` overrides of every config key and a
config file (YAML of hostile values, or text that is not a mapping, not UTF-8, an alias chain, a numeric sweep
key); ``train`` and ``eval`` read a data file of hostile lines.

Speed: examples call ``cli.main(argv)`` in process (stdout and stderr captured, ``SystemExit`` taken as the
exit code), which is what the installed command runs. ``train`` runs up to the moment it would ask for the
model service, with its run directory and metadata written, and stops there (``Accepted``): the training
steps themselves are the e2e tier's. ``cookbook`` binds the tinker SDK in its process, so it runs only in
the subprocess examples, which call the installed ``rlrunbook`` as a user types it.

Profiles (conftest.py): ``ci`` (derandomized, what ``scripts/test.sh`` runs) tries ``CI_EXAMPLES`` in-process
and ``SUBPROCESS_EXAMPLES`` subprocess examples; ``dev`` is the long local run, randomized (one subprocess
example per 50 in-process ones), e.g. ``HYPOTHESIS_PROFILE=dev
RLRUNBOOK_HYPOTHESIS_EXAMPLES=5000 pytest tests/unit/cli/test_fuzz.py`` (see docs/testing.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from rlrunbook import cli
from rlrunbook.rl.setup.config_sources import leaf_keys
from rlrunbook.testing.commands import installed_rlrunbook

CI_EXAMPLES = 100
SUBPROCESS_EXAMPLES = 4
EXAMPLE_SECONDS = 90  # an example of this file takes seconds; a hang is what this catches
EXAMPLES = CI_EXAMPLES if settings.default.derandomize else settings.default.max_examples
SUBPROCESS_RUNS = SUBPROCESS_EXAMPLES if settings.default.derandomize else max(SUBPROCESS_EXAMPLES, EXAMPLES // 50)
TRACEBACK = "Traceback (most recent call last)"
# No shrinking: an example costs seconds, and the failing one is printed whole.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
DOCUMENTED_EXIT_CODES = {0, 1, 2}

# What each command gets before the drawn options: a small valid command line (later options replace these).
BASE = {
    "train": ["--model", "tiny", "-n", "2", "--num-groups", "1", "-s", "1", "--max-tokens", "4"],
    "show-config": ["--model", "tiny"],
    "check-logprobs": ["--model", "tiny", "--max-tokens", "4", "--num-samples", "1"],
    "eval": ["--model", "tiny", "--num-problems", "2", "--samples", "2", "--ks", "1", "--max-tokens", "4",
             "--resamples", "10"],
    "eval-checkpoints": ["--num-problems", "1", "--samples", "1", "--ks", "1", "--resamples", "10"],
    "resolve-model": [],
}
# Positional arguments (RUN_DIR, a model name, a recipe) are drawn from these.
POSITIONALS = {
    "check-run": "run_dir", "summarize": "run_dir", "package": "run_dir", "eval-checkpoints": "run_dir",
    "resolve-model": "model",
}
IN_PROCESS = sorted(set(BASE) | set(POSITIONALS) | {"bench-history"})
OUTPUT_OPTIONS = {"--out", "--log-root", "--png"}
OUTPUT_KEYS = {"log_root", "data.cache_dir"}

# The sandbox every example runs in (its working directory).
PATHS = ["run", "run/run_metadata.json", "run/checkpoints", "run/checkpoints/step_000001", "notrun", "afile.txt",
         "cfg.yaml", "data.jsonl", "missing/x", "out/x.json", "out/t.csv", "out/t.md", "out/a.tar.gz", "out/p.png",
         "logs", "afile.txt/below", "/nonexistent-rlrunbook-fuzz/x", "", ".", "-", "run\nname", "\udcff"]
NUMBERS = ["0", "1", "2", "3", "-1", "-0", "1e12", "-1e-4", "0.5", "nan", "inf", "-inf", "1e309", "1_000", "0x10",
           "100000000000000000000000", "9" * 400, "abc", "", " 1", "true", "1e-320"]
TEXT = st.one_of(
    st.sampled_from(["tiny", "qa", "summary", "math", "debate", "single_turn", "test", "a\nb", "a\rb", "\udcff",
                     "--", "-", "=", "x=y", "../..", "\u2028", "sk-proj-Zx81bQ0fakeKey7", "https://u:pw-4f9x2@h/x",
                     "é" * 300, "logs", "run"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
)
VALUE_OF_KEY = st.one_of(st.sampled_from(NUMBERS), TEXT, st.sampled_from(PATHS[:14]))


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


COMMANDS = _subcommands()


def _is_number_type(action: argparse.Action) -> bool:
    return action.type in (int, float) or getattr(action.type, "__name__", "").startswith("_positive")


def _value(action: argparse.Action) -> st.SearchStrategy[str]:
    if action.choices:
        return st.one_of(st.sampled_from([str(c) for c in action.choices]), TEXT)
    if _is_number_type(action):
        return st.sampled_from(NUMBERS)
    return st.one_of(st.sampled_from(PATHS), TEXT)


def _option(action: argparse.Action) -> st.SearchStrategy[list[str]]:
    flag = st.sampled_from(action.option_strings)
    if action.nargs == 0:
        return flag.map(lambda f: [f])
    count = st.integers(0 if action.nargs == "*" else 1, 3) if action.nargs in ("+", "*") else st.just(1)
    return st.tuples(flag, count.flatmap(lambda n: st.lists(_value(action), min_size=n, max_size=n))).map(
        lambda fv: [fv[0], *fv[1]])


def _options(command: str) -> st.SearchStrategy[list[str]]:
    actions = [a for a in COMMANDS[command]._actions if a.option_strings and a.option_strings != ["-h", "--help"]]
    if not actions:
        return st.just([])
    return st.lists(st.one_of(*[_option(a) for a in actions]), max_size=2).map(lambda parts: sum(parts, []))


OVERRIDE = st.tuples(st.sampled_from([*leaf_keys(), "extra.test_size", "extra.openai_key", "nosuch.key"]),
                     VALUE_OF_KEY).map(lambda kv: f"{kv[0]}={kv[1]}")

YAML_SCALAR = st.sampled_from(["0", "-1", "1e12", ".nan", ".inf", "true", "null", "abc", "'x'", "[]", "{}",
                               "100000000000000000000000", "'\\u2028'", "~"])
CONFIG_TEXT = st.one_of(
    st.sampled_from(["", "steps: 1\n", "model: tiny\nseed: 3\n"]),
    st.lists(st.tuples(st.sampled_from([*leaf_keys(), "steps", "steps", "nosuch"]), YAML_SCALAR), max_size=4).map(
        lambda items: "".join(f"{k}: {v}\n" for k, v in items)),
    st.sampled_from([
        "- a\n- b\n",  # not a mapping
        "steps: [1, 2\n",  # not YAML
        "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: [*c, *c]\n",  # an alias chain
        "sweep:\n  1: [a, b]\n",  # a numeric sweep key
        "sweep:\n  learning_rate: [0.1, 0.1]\n",  # a repeated sweep point
        "sweep:\n  extra.api_key: [sk-proj-Zx81bQ0fakeKey7, k2]\n",
        "name: \"a\\nb\"\n",
        "model: tiny\nsteps: true\n",
        "[" * 5000 + "]" * 5000 + "\n",
    ]),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)
CONFIG_BYTES = st.one_of(CONFIG_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
                         st.just(b"\xff\xfe\x00steps: 1\n"), st.just(b"model: tiny\nname: \xe9t\xe9\n"))
DATA_LINE = st.one_of(
    st.builds(lambda q, a: json.dumps({"question": q, "answer": a}),
              st.sampled_from(["What is 2 + 3?", "", "\u2028", "x" * 2000]),
              st.sampled_from(["#### 5", "5", "", "#### " + "1" * 5001, "#### \u0085"])),
    st.sampled_from(["", "{}", "[]", "null", "1", '{"question": 1, "answer": []}', '{"question": "q"}',
                     "[" * 100000 + "]" * 100000, '{"question": "a\u2028b", "answer": "1"}', "not json",
                     '{"question": "\\ud800", "answer": "1"}', '{"question": "q", "answer": "1", "answer": "2"}']),
)
VALID_DATA = "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                     for i in range(8))
DATA_BYTES = st.one_of(st.just(VALID_DATA.encode()),
                       st.lists(DATA_LINE, max_size=5).map(lambda lines: (VALID_DATA + "\n".join(lines)).encode()),
                       st.lists(DATA_LINE, max_size=5).map(lambda lines: "\n".join(lines).encode()),
                       st.just(b'{"question": "\xff", "answer": "1"}\n'), st.just(b"\x1f\x8b\x08\x00garbage"))


@dataclass
class Case:
    command: str
    argv: list[str]
    config: bytes = b""
    data: bytes = b""
    outputs: set[str] = field(default_factory=set)


@st.composite
def cases(draw, commands: list[str]) -> Case:
    command = draw(st.sampled_from(commands))
    argv = [command, *BASE.get(command, [])]
    if command in POSITIONALS:
        kind = POSITIONALS[command]
        pool = PATHS if kind == "run_dir" else ["tiny", "no-such/model", "notrun", "afile.txt", "", "\udcff"]
        argv += draw(st.lists(st.sampled_from(pool), min_size=1, max_size=1 if command != "summarize" else 3))
    # Half the examples change one thing of a valid command line, so that a drawn value meets the code behind
    # the first check; the others change several at once.
    kinds = draw(st.sets(st.sampled_from(["options", "overrides", "config", "data"]),
                         max_size=draw(st.sampled_from([1, 4]))))
    if "options" in kinds:
        argv += draw(_options(command))
    if command in ("train", "show-config"):
        if "overrides" in kinds:
            argv += draw(st.lists(OVERRIDE, min_size=1, max_size=2))
        if "config" in kinds:
            argv += ["--config-file", "cfg.yaml"]
    if command in ("train", "eval") and "data" in kinds:
        argv += ["--dataset", "data.jsonl"]
    if command == "package" and draw(st.booleans()):
        argv += ["--out", draw(st.sampled_from(["out/a.tar.gz", "run/inside.tar.gz", "afile.txt", "out/x.json"]))]
    case = Case(command, argv, draw(CONFIG_BYTES), draw(DATA_BYTES))
    case.outputs = _outputs(case)
    return case


def case_of(command: str, argv: list[str], config: bytes = b"", data: bytes = b"") -> Case:
    """An explicit example: ``argv`` after the command's base command line."""
    case = Case(command, [command, *BASE.get(command, []), *argv], config, data)
    case.outputs = _outputs(case)
    return case


def _outputs(case: Case) -> set[str]:
    """The paths the command was told to write to (files and folders below them too): output options, output
    keys in overrides or the config file, and the defaults."""
    outputs = {"logs", "cache"}
    for index, arg in enumerate(case.argv):
        if arg in OUTPUT_OPTIONS and index + 1 < len(case.argv):
            outputs.add(case.argv[index + 1])
        flag, _, value = arg.partition("=")
        if flag in OUTPUT_OPTIONS | OUTPUT_KEYS:
            outputs.add(value)
    for line in case.config.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in OUTPUT_KEYS:
            outputs.add(value.strip().strip("'\""))
    if case.command == "package":
        outputs |= {f"{p}.tar.gz" for p in PATHS}
    return {os.path.normpath(p) for p in outputs if p}


def _snapshot(root: Path) -> dict[str, str]:
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = f"link {os.readlink(path)}"
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


def _changed_outside(before: dict[str, str], after: dict[str, str], outputs: set[str]) -> list[str]:
    def allowed(rel: str) -> bool:
        return any(rel == out or rel.startswith(out.rstrip("/") + "/") for out in outputs)

    changed = {rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel)}
    return sorted(rel for rel in changed if not allowed(rel))


class Accepted(BaseException):
    """Raised where ``train`` would ask for the model service: everything it reads and checks has passed."""


class TooSlow(BaseException):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def expire(signum, frame):
        raise TooSlow(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """One finished run of ``tiny`` with a checkpoint: what check-run, summarize, package, eval-checkpoints and
    --resume-from are pointed at."""
    root = tmp_path_factory.mktemp("fuzz-base")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["train", "--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "8", "--num-groups",
                         "2", "-s", "1", "--max-tokens", "32", "--seed", "1", "--checkpoint-every", "1",
                         "--log-root", str(root)])
    assert code == 0, err.getvalue()[-3000:]
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


@contextlib.contextmanager
def _sandbox(base_run: Path, case: Case) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rlrunbook-fuzz-") as name:
        root = Path(name)
        shutil.copytree(base_run, root / "run", symlinks=True)
        (root / "notrun").mkdir()
        (root / "afile.txt").write_text("a file\n")
        (root / "out").mkdir()
        (root / "cfg.yaml").write_bytes(case.config)
        (root / "data.jsonl").write_bytes(case.data)
        yield root


# Folders of the sandbox (set as absolute paths), fixed values, and variables removed.
_SANDBOX_PATHS = {"RLRUNBOOK_LOG_ROOT": "logs", "RLRUNBOOK_CACHE_DIR": "cache", "TINKER_LOCAL_STORAGE": "cache/storage"}
_ENVIRON = {"TINKER_BACKEND": "local", "WANDB_PROJECT": None}


def _example_environ(root: Path) -> dict[str, str | None]:
    return {**{key: str(root / value) for key, value in _SANDBOX_PATHS.items()}, **_ENVIRON}


@contextlib.contextmanager
def _environment(root: Path) -> Iterator[None]:
    wanted = _example_environ(root)
    saved_env = {key: os.environ.get(key) for key in wanted}
    saved_cwd = os.getcwd()
    saved_argv = sys.argv[:]
    for key, value in wanted.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.chdir(root)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        sys.argv[:] = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_in_process(argv: list[str]) -> tuple[int, str, float]:
    """``cli.main(argv)`` as the installed command runs it: (exit code, stdout and stderr, seconds). An
    exception out of ``main`` is re-raised as a failure naming it: a user would have seen a traceback."""
    from rlrunbook.rl.training import loop

    def stop(*args, **kwargs):
        raise Accepted()

    out = io.StringIO()
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "default_service", stop)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), _time_limit(EXAMPLE_SECONDS):
                code = cli.main(argv)
        except SystemExit as exit_:  # argparse, and -h
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Accepted:
            code = 0
        except TooSlow:
            pytest.fail(f"{argv!r}: no answer in {EXAMPLE_SECONDS} s\n{out.getvalue()[-2000:]}", pytrace=False)
        except Exception as error:  # noqa: BLE001 - the invariant is that nothing gets here
            import traceback

            pytest.fail(f"{argv!r}: {type(error).__name__} out of cli.main (a user sees a traceback):\n"
                        f"{''.join(traceback.format_exception(error))[-3000:]}\n{out.getvalue()[-2000:]}",
                        pytrace=False)
    return code, out.getvalue(), time.monotonic() - started


def check_invariants(case: Case, code: int, output: str, changed: list[str]) -> None:
    shown = f"{case.argv!r}\nconfig file: {case.config[:300]!r}\ndata file: {case.data[:300]!r}"
    assert code in DOCUMENTED_EXIT_CODES, f"{shown}\nexit {code}, not one of {sorted(DOCUMENTED_EXIT_CODES)}:\n" \
                                          f"{output[-2000:]}"
    assert TRACEBACK not in output, f"{shown}\nexit {code} with a traceback:\n{output[-3000:]}"
    assert not changed, f"{shown}\nchanged outside the output paths {sorted(case.outputs)}: {changed}"


# Inputs that once broke an invariant (issue 24). The last three are the classes the one error boundary of
# issue 24, point 1 turns into exit 2: text that is not UTF-8, lone surrogates, a file system's refusal.
@example(case=case_of("eval", ["--temperature", "nan"]))  # a pydantic ValidationError, not a ConfigError
@example(case=case_of("eval", ["--temperature", "9" * 400]))
@example(case=case_of("show-config", ["--config-file", "cfg.yaml"], config=b"sweep:\n  1: [a, b]\n"))
@example(case=case_of("eval", ["--dataset", "data.jsonl"], data=b'{"question": "\xff", "answer": "#### 1"}\n'))
@example(case=case_of("summarize", ["run", "\udcff", "--out", "out/t.csv"]))
@example(case=case_of("summarize", ["run", "--out", "out/" + "\u00e9" * 300 + ".csv"]))
@settings(max_examples=EXAMPLES, suppress_health_check=list(HealthCheck), deadline=None,
          phases=PHASES)
@given(case=cases(IN_PROCESS))
def test_every_command_holds_its_invariants_in_process(base_run, case):
    with _sandbox(base_run, case) as root, _environment(root):
        before = _snapshot(root)
        code, output, _ = run_in_process(case.argv)
        changed = _changed_outside(before, _snapshot(root), case.outputs)
    check_invariants(case, code, output, changed)


def _entry_point() -> str:
    return installed_rlrunbook()


RECIPES = ["no_such_recipe_module", "tinker_cookbook.recipes.no_such_recipe", "fuzz_probe_recipe", "-", ""]
PROBE_RECIPE = "import sys\nprint('probe', sys.argv[1:])\n"


@st.composite
def subprocess_cases(draw) -> Case:
    command = draw(st.sampled_from(["cookbook", "cookbook", "show-config", "summarize", "package", "check-run"]))
    if command != "cookbook":
        return draw(cases([command]))
    argv = ["cookbook", *draw(_options("cookbook")), draw(st.sampled_from(RECIPES)),
            *draw(st.lists(st.one_of(TEXT, st.sampled_from(["--flag", "model_name=tiny"])), max_size=3))]
    case = Case("cookbook", argv, b"", draw(DATA_BYTES))
    case.outputs = _outputs(case)
    return case


@settings(max_examples=SUBPROCESS_RUNS, suppress_health_check=list(HealthCheck), deadline=None,
          phases=PHASES)
@given(case=subprocess_cases())
@pytest.mark.slow
def test_the_installed_command_holds_them_too(base_run, case):
    """A few examples through the console script, as a user runs it (the process's own exit code and output)."""
    with _sandbox(base_run, case) as root:
        (root / "fuzz_probe_recipe.py").write_text(PROBE_RECIPE)
        before = _snapshot(root)
        environ = {**os.environ, **_example_environ(root), "PYTHONPATH": str(root)}
        environ = {key: value for key, value in environ.items() if value is not None}
        argv = [arg.encode("utf-8", "surrogateescape") if "\udcff" in arg else arg for arg in case.argv]
        try:
            done = subprocess.run([_entry_point(), *argv], capture_output=True, cwd=root, env=environ,
                                  timeout=EXAMPLE_SECONDS * 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{case.argv!r}: no answer in {EXAMPLE_SECONDS * 2} s", pytrace=False)
        output = (done.stdout + done.stderr).decode("utf-8", "replace")
        changed = _changed_outside(before, _snapshot(root), case.outputs | {"__pycache__"})
    check_invariants(case, done.returncode, output, changed)
