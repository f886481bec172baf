"""The simple commands of a shell script, split as the shell splits them: what the CI and workflow checks read."""

from __future__ import annotations

import re
import shlex


def simple_commands(script: str, keep_assignments: bool = False) -> list[list[str]]:
    """The simple commands of ``script`` as word lists: quotes kept together; a line end, ``&&``, ``||``, ``;``,
    ``|`` or ``&`` ends a command; ``#`` comments dropped, and leading ``VAR=value`` assignments unless
    ``keep_assignments``."""
    tokens = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens += [*lexer, ";"]
    commands, words = [], []
    for token in tokens:
        if token in ("&&", "||", ";", "|", "&", ";;"):
            while words and not keep_assignments and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                words = words[1:]
            if words:
                commands.append(words)
            words = []
        else:
            words.append(token)
    return commands
