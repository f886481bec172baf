"""The commands the documentation shows are commands the code accepts.

Every ``rlrunbook ...`` command in README.md and docs/*.md (in shell code blocks, and in inline code spans
that start with ``rlrunbook ``) must name a subcommand of ``rlrunbook.cli.build_parser()``, use only options
of that subcommand's parser, name presets that exist and set only config keys that exist; one shown with
concrete values must parse. ``python -m rlrunbook.cookbook ...`` is checked against the cookbook runner's
parser. The scripts the pages run, the repository paths they name and the pages they link must exist.
Placeholders (``<run>``, ``RUN_DIR``, ``N``, ``...``, ``a|b`` alternatives) are tolerated where a value goes.

Everything runs in process on the parser objects, except the calls of the installed ``rlrunbook`` entry
point, as a user types it: ``--help``, ``<command> -h`` for every command the README shows, and
``rlrunbook cookbook --renderer R --hf-dataset NAME=FILE <recipe>`` running a recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlrunbook import cli
from rlrunbook.cookbook import runner as cookbook_runner
from rlrunbook.rl.setup.config_sources import PRESET_DIR, leaf_keys, list_presets
from rlrunbook.testing.commands import installed_rlrunbook

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGE_IDS = [page.relative_to(ROOT).as_posix() for page in PAGES]

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}  # fenced blocks whose lines are commands
INLINE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Paths inside the repository that a page names: they must exist.
REPO_PATH = re.compile(r"(?<![\w./-])((?:src|tests|scripts|configs|docs)/[\w./-]*[\w/])")
# A file of the project named by its tail (``engines/products.py``, ``test_noise.py``): some file must end so.
PY_FILE = re.compile(r"(?<![\w./-])([\w/-]*\w\.py)\b")
SCRIPT = re.compile(r"\b(?:bash|sh|python3?)\s+(scripts/[\w.-]+\.(?:sh|py))\b")
SEPARATORS = {"&&", "||", ";", "|"}
PREFIXES = {"time", "exec", "nice", "-n", "10", "env"}  # words that may stand before a command
TRAIN_LIKE = {"train", "show-config"}


@dataclass(frozen=True)
class Shown:
    """One command shown in a page: where, and its arguments after ``rlrunbook`` (or, with ``runner``, after
    ``python -m rlrunbook.cookbook``)."""

    page: str
    line: int
    text: str
    args: tuple[str, ...]
    runner: bool = False
    inline: bool = False

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {' '.join(self.text.split())}"

    @property
    def name(self) -> str:
        return "cookbook" if self.runner else (_clean(self.args[0]) if self.args else "")


def _is_placeholder(token: str) -> bool:
    """A value a user replaces: ``<run>``, ``RUN_DIR``, ``N``, ``...``, ``hf|vllm``, ``logs/*``."""
    return (token in {"...", "…"} or "<" in token or ">" in token or "|" in token or "*" in token
            or re.fullmatch(r"[A-Z][A-Z0-9_]*(=[A-Z0-9_.,]+)?", token) is not None)


def _clean(token: str) -> str:
    """A token without the brackets of a synopsis (``[--seed S]``) or a trailing ellipsis or comma."""
    token = token.lstrip("[(")
    while token.endswith(("]", ")", "...", ",")) and token not in {"...", ")"}:
        token = token.removesuffix("...").rstrip("]),")
    return token


def _split_shell(text: str) -> list[str] | None:
    """Tokens of a shell line (comments dropped); None when it is not shell syntax."""
    try:
        return shlex.split(text.replace("\\|", "|"), comments=True)
    except ValueError:
        return None


def _commands_in(tokens: list[str]) -> list[tuple[bool, tuple[str, ...]]]:
    """``(runner, arguments)`` of each command in one shell line (``a && b`` holds two).

    ``rlrunbook`` counts where a command starts: first in its part of the line, after ``NAME=value``
    assignments or a ``time``/``nice``/``exec`` prefix, or as ``-m rlrunbook`` (``torchrun ... -m
    rlrunbook``).
    ``-m rlrunbook.cookbook`` is the cookbook runner.
    """
    found: list[tuple[bool, tuple[str, ...]]] = []
    current: list[str] | None = None
    runner = False
    at_start = True
    for index, token in enumerate(tokens):
        if token in SEPARATORS or token.endswith(";"):
            if current is not None:
                last = [token[:-1]] if token.endswith(";") and token != ";" else []  # `... logs/<run>;`
                found.append((runner, tuple(current + last)))
            current, at_start = None, True
            continue
        after_m = index > 0 and tokens[index - 1] == "-m"
        if current is not None:
            current.append(token)
        elif (at_start and token.rsplit("/", 1)[-1] == "rlrunbook") or (after_m and token == "rlrunbook"):
            current, runner = [], False
        elif after_m and token == "rlrunbook.cookbook":
            current, runner = [], True
        elif not (re.fullmatch(r"[A-Za-z_]\w*=\S*", token) or token in PREFIXES):
            at_start = False
    if current is not None:
        found.append((runner, tuple(current)))
    return found


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """Lines of a code block with backslash continuations joined, each with its offset in the block."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(block.splitlines()):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def _prose(text: str) -> str:
    """``text`` with fenced blocks blanked (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def shown_commands(page: Path) -> list[Shown]:
    """Every command of ``page``: in shell code blocks, and in inline spans that start with ``rlrunbook ``."""
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    shown: list[Shown] = []
    for block in FENCE.finditer(text):
        if block.group(1).strip().lower() not in SHELL_BLOCKS:
            continue
        first_line = text.count("\n", 0, block.start(2)) + 1
        for offset, line in _logical_lines(block.group(2)):
            for runner, args in _commands_in(_split_shell(line) or []):
                shown.append(Shown(name, first_line + offset, line, args, runner))
    prose = re.sub(r"^#.*$", "", _prose(text), flags=re.MULTILINE)  # a heading names a command, runs none
    for span in INLINE.finditer(prose):
        code = span.group(2).strip()
        if not code.startswith("rlrunbook "):
            continue
        line = prose.count("\n", 0, span.start()) + 1
        tokens = _split_shell(code)
        if tokens is None:  # an unbalanced quote: the words still show the options
            tokens = code.replace("\\|", "|").split()
        for runner, args in _commands_in(tokens):
            shown.append(Shown(name, line, code, args, runner, inline=True))
    return shown


ALL_SHOWN = [command for page in PAGES for command in shown_commands(page)]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{command: its parser}`` of the top-level parser's subcommands."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1, "rlrunbook's parser is expected to hold one set of subcommands"
    return dict(actions[0].choices)


COMMANDS = _subparsers(cli.build_parser())


def _options(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(option for action in parser._actions for option in action.option_strings)


@functools.cache
def _runner_options() -> frozenset[str]:
    """The options of the cookbook runner, which parses ``rlrunbook cookbook``'s arguments itself."""
    captured: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured.append(self)
        return real(self, args, namespace)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        cookbook_runner.parse_args(["some.recipe"])
    return _options(captured[0])


def _flags(args: tuple[str, ...]) -> list[str]:
    """The options a command uses: ``--flag`` (``--flag=value`` too) and single-letter ``-n``."""
    flags = []
    for raw in args:
        token = _clean(raw)
        if re.fullmatch(r"--[A-Za-z][\w-]*(=.*)?", token) or re.fullmatch(r"-[A-Za-z]", token):
            flags.append(token.split("=", 1)[0])
    return flags


def _values_of(args: tuple[str, ...], flag: str) -> list[str]:
    """The values given to ``flag`` (``--flag value`` or ``--flag=value``)."""
    values = []
    cleaned = [_clean(a) for a in args]
    for index, token in enumerate(cleaned):
        if token == flag and index + 1 < len(cleaned):
            values.append(cleaned[index + 1])
        elif token.startswith(flag + "="):
            values.append(token.split("=", 1)[1])
    return values


def _runner_arguments(args: tuple[str, ...]) -> tuple[str, ...]:
    """The cookbook runner's own arguments: those before the recipe module (the rest are the recipe's)."""
    kept: list[str] = []
    expect_value = False
    for raw in args:
        token = _clean(raw)
        if expect_value:
            kept.append(raw)
            expect_value = False
        elif token.startswith("-"):
            kept.append(raw)
            expect_value = "=" not in token and token not in {"-h", "--help"}
        else:
            break
    return tuple(kept)


def _parse(parse, args: list[str]) -> str | None:
    """None when ``parse(args)`` accepts them (``-h`` included), else what argparse said."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            parse(args)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return out.getvalue().strip() or f"exit {exit_.code}"
    return None


def test_the_pages_show_commands():
    """The extraction finds the commands (an empty list would make the tests below pass vacuously)."""
    assert (ROOT / "docs" / "cli.md") in PAGES
    assert len(ALL_SHOWN) >= 20, [str(c) for c in ALL_SHOWN]
    assert {"train", "check-run", "eval", "summarize"} <= {c.name for c in ALL_SHOWN}


def test_the_extraction_reads_shell_lines_as_a_user_types_them():
    """Continuations, env prefixes, ``&&`` chains, ``-m rlrunbook``, synopsis brackets and prose mentions."""
    block = ("TINKER_LOCAL_DTYPE=bfloat16 rlrunbook train --model tiny \\\n  --seed 3   # a comment\n"
             ".venv/bin/rlrunbook check-run logs/<run> && .venv/bin/rlrunbook summarize logs/*\n"
             "torchrun --nproc_per_node=2 -m rlrunbook train -s 2\n"
             "python -m rlrunbook.cookbook --renderer qwen3_instruct some.recipe x=1\n"
             "echo the rlrunbook command\n")
    got = [found for _, line in _logical_lines(block) for found in _commands_in(_split_shell(line))]
    assert got == [(False, ("train", "--model", "tiny", "--seed", "3")), (False, ("check-run", "logs/<run>")),
                   (False, ("summarize", "logs/*")), (False, ("train", "-s", "2")),
                   (True, ("--renderer", "qwen3_instruct", "some.recipe", "x=1"))]
    assert _flags(("train", "[--seed", "S]", "[-n", "N]...", "--sweep=a=1,2")) == ["--seed", "-n", "--sweep"]
    assert _is_placeholder("RUN_DIR") and _is_placeholder("<run>") and not _is_placeholder("tiny-cpu-smoke")


@pytest.mark.parametrize("command", ALL_SHOWN, ids=str)
def test_shown_command_exists_and_takes_its_options(command: Shown):
    assert command.runner or command.args, f"{command}: `rlrunbook` without a subcommand"
    if _is_placeholder(command.name):  # `rlrunbook <command> -h`
        return
    assert command.name in COMMANDS, (f"{command}: no subcommand {command.name!r}; "
                                      f"rlrunbook has {sorted(COMMANDS)}")
    if command.name == "cookbook":
        given = command.args if command.runner else command.args[1:]
        flags, known = _flags(_runner_arguments(given)), _runner_options()
    else:
        flags, known = _flags(command.args[1:]), _options(COMMANDS[command.name])
    unknown = [flag for flag in flags if flag not in known]
    assert not unknown, (f"{command}: `rlrunbook {command.name}` has no option {unknown}; "
                         f"its options: {sorted(known)}")


@pytest.mark.parametrize("command", [c for c in ALL_SHOWN if "--config-file" in _flags(c.args)], ids=str)
def test_shown_config_files_exist(command: Shown):
    for value in _values_of(command.args, "--config-file"):
        if _is_placeholder(value):
            continue
        if Path(value).suffix or "/" in value:  # a path: the repository's own must exist, a user's may not
            if value.startswith("configs/"):
                assert (ROOT / value).is_file(), f"{command}: {value} does not exist"
            continue
        assert (PRESET_DIR / f"{value}.yaml").is_file(), (
            f"{command}: no preset {value!r} under configs/; presets: {list_presets()}")


@pytest.mark.parametrize("command", [c for c in ALL_SHOWN if c.name in TRAIN_LIKE and not c.runner], ids=str)
def test_shown_overrides_name_config_keys(command: Shown):
    """``key.sub=value`` arguments and ``--sweep key=...`` of train and show-config set fields that exist."""
    keys = set(leaf_keys())
    given = [_clean(a) for a in command.args[1:] if re.fullmatch(r"[a-z_][\w.]*=.*", _clean(a))]
    given += _values_of(command.args, "--sweep")
    for item in given:
        key = item.split("=", 1)[0]
        if _is_placeholder(key) or key.startswith("extra."):  # extra holds task options, any key
            continue
        assert key in keys, f"{command}: {key!r} is not a config key"


@pytest.mark.parametrize("command", ALL_SHOWN, ids=str)
def test_concrete_commands_parse(command: Shown):
    """A command shown with real values parses (choices and types hold too). A cookbook command always
    parses: its positionals take any text, and the recipe's arguments are the recipe's. A command named in
    prose without its arguments (`rlrunbook summarize`) is a reference, not a command line."""
    args = [token for token in (_clean(a) for a in command.args) if token not in {"...", "…"}]
    if command.inline and len(args) <= (0 if command.runner else 1):
        return
    if command.name == "cookbook":
        if command.runner:
            error = _parse(cookbook_runner.parse_args, args)
        else:  # `rlrunbook cookbook` takes the runner's command line itself
            error = _parse(cli.parse_args, args)
    elif any(_is_placeholder(a) for a in args):
        return
    else:
        error = _parse(cli.parse_args, args)
    assert error is None, f"{command}: does not parse: {error}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_scripts_and_repository_paths_exist(page: Path):
    text = page.read_text()
    missing = [script for script in SCRIPT.findall(text) if not (ROOT / script).is_file()]
    assert not missing, f"{page.name}: runs scripts that do not exist: {missing}"
    missing = sorted({path for path in REPO_PATH.findall(text)
                      if not _is_placeholder(path) and not (ROOT / path).exists()})
    assert not missing, f"{page.name}: names paths that do not exist: {missing}"
    files = [path.relative_to(ROOT).as_posix() for folder in ("src", "tests", "scripts", "examples")
             for path in (ROOT / folder).rglob("*.py")] + ["conftest.py"]
    shell = [block.group(2) for block in FENCE.finditer(text)
             if block.group(1).strip().lower() in SHELL_BLOCKS]
    spans = [span.group(2) for span in INLINE.finditer(_prose(text))]
    named = {tail for chunk in shell + spans for tail in PY_FILE.findall(chunk)}
    missing = sorted(tail for tail in named if not any(f == tail or f.endswith("/" + tail) for f in files))
    assert not missing, f"{page.name}: names Python files the project does not have: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(match) for match in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(page.read_text()),
                                                    re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_relative_links_resolve(page: Path):
    """Every relative link points at an existing file (and heading, where it names one)."""
    problems = []
    for match in LINK.finditer(_prose(page.read_text())):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            problems.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not problems, f"{page.name}: {problems}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_environment_variables_exist(page: Path):
    """Every ``TINKER_*`` / ``RLRUNBOOK_*`` variable a page names is read somewhere in the project."""
    sources = "\n".join(path.read_text(errors="replace") for folder in ("src", "scripts", "tests")
                        for path in (ROOT / folder).rglob("*") if path.suffix in {".py", ".sh"})
    sources += "".join((ROOT / name).read_text() for name in ("conftest.py", "tox.ini"))
    named = set(re.findall(r"\b((?:TINKER|RLRUNBOOK)_[A-Z0-9_]*[A-Z0-9])\b", page.read_text()))
    missing = sorted(name for name in named if name not in sources)
    assert not missing, f"{page.name}: names variables the project does not read: {missing}"


def test_cli_reference_covers_every_command_and_option():
    """docs/cli.md has a section per subcommand that names each of its long options (or links to the section
    of a command that takes the same ones, as show-config does to train)."""
    reference = (ROOT / "docs" / "cli.md").read_text()
    heading = re.compile(r"^##\s+`?rlrunbook ([\w-]+)`?\s*\n(.*?)(?=^##\s|\Z)", re.MULTILINE | re.DOTALL)
    sections = {match.group(1): match.group(2) for match in heading.finditer(reference)}
    absent = sorted(set(COMMANDS) - set(sections))
    assert not absent, f"docs/cli.md lacks sections for {absent}"
    for name, parser in COMMANDS.items():
        linked = re.findall(r"\]\(#rlrunbook-([\w-]+)\)", sections[name])
        text = sections[name] + "".join(sections.get(other, "") for other in linked if other != name)
        options = _runner_options() if name == "cookbook" else _options(parser)
        missing = sorted(option for option in options if option.startswith("--") and option != "--help"
                         and not re.search(rf"{re.escape(option)}(?![\w-])", text))
        assert not missing, f"docs/cli.md, rlrunbook {name}: options not described: {missing}"


def test_every_subcommand_help_parses():
    """``rlrunbook <command> -h`` for every subcommand, in process: each prints its usage and exits 0."""
    assert {"train", "check-run", "eval", "summarize", "check-logprobs"} <= set(COMMANDS)
    for name in COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args([name, "-h"])
        assert exit_.value.code == 0, name
        assert out.getvalue().startswith(f"usage: rlrunbook {name}"), out.getvalue()


def _installed_entry_point() -> str:
    return installed_rlrunbook()


def test_installed_entry_point_lists_every_command():
    """The command users type: the console script installed with the package, run once as a user would."""
    done = subprocess.run([_installed_entry_point(), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: rlrunbook"), done.stdout
    missing = [name for name in COMMANDS if name not in done.stdout]
    assert not missing, f"`rlrunbook --help` does not list {missing}:\n{done.stdout}"


@pytest.mark.slow
def test_installed_entry_point_takes_every_command_the_readme_shows():
    """``rlrunbook <command> -h`` through the console script for each command README.md shows (all at once: each
    is a process of its own)."""
    shown = sorted({c.name for c in ALL_SHOWN if c.page == "README.md" and c.name in COMMANDS})
    assert {"train", "check-run", "show-config", "eval", "summarize"} <= set(shown)
    entry = _installed_entry_point()
    running = {name: subprocess.Popen([entry, name, "-h"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name in shown}
    failed = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=300)
        if process.returncode != 0 or not out.startswith(f"usage: rlrunbook {name}"):
            failed[name] = (process.returncode, err[-2000:])
    assert not failed, failed


PROBE_RECIPE = """
import datasets, json, sys
from tinker_cookbook import model_info
out = {"argv": sys.argv[1:], "renderers": list(model_info.get_model_attributes("probe-model").recommended_renderers),
       "rows": list(datasets.load_dataset("probe/set", split="train")["question"])}
open(sys.argv[1], "w").write(json.dumps(out))
"""


@pytest.mark.slow
def test_installed_cookbook_command_takes_the_runner_options_before_the_recipe(tmp_path):
    """The form docs/cli.md shows, typed as a user types it: the runner's options (which once ended in
    `unrecognized arguments`) take effect, and the recipe gets its own arguments, options included."""
    (tmp_path / "probe_recipe.py").write_text(PROBE_RECIPE)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "q0", "answer": "0"}\n{"question": "q1", "answer": "1"}\n')
    result = tmp_path / "result.json"
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
               "TINKER_BACKEND": "local"}
    done = subprocess.run([_installed_entry_point(), "cookbook", "--renderer", "qwen3_instruct", "--hf-dataset",
                           f"probe/set={data}", "probe_recipe", str(result), "model_name=tiny", "--flag"],
                          capture_output=True, text=True, timeout=300, env=environ, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(result.read_text()) == {"argv": [str(result), "model_name=tiny", "--flag"],
                                              "renderers": ["qwen3_instruct"], "rows": ["q0", "q1"]}
