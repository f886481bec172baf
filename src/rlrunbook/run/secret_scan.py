r"""A content scan for secrets: private keys and common API token shapes, reported by file and line.

``rlrunbook package`` refuses a run directory in which this finds anything (``--allow-secrets`` overrides).
It complements the scan for the values of secret environment variables (``run.tools.find_secrets``),
which only knows what is set in the current shell. The patterns, and why each is safe to search for in
a run directory (whose files hold hex digests, token ids, floats and model text):

=====================  ===========================================================  =============================
name                   pattern                                                      example shape
=====================  ===========================================================  =============================
private key            ``-----BEGIN [A-Z ]*PRIVATE KEY( BLOCK)?-----``                 PEM / OpenSSH / PGP key files,
                                                                                    a service account's JSON
OpenAI-style key       ``sk-`` (``sk-proj-``, ``sk-ant-``...) then 8+ of ``[A-Za-z0-9_-]``  ``sk-...``, Anthropic
                       with at least one digit, at a word start
AWS access key id      ``(AKIA|ASIA)`` + 16 of ``[0-9A-Z]``                              ``AKIA...``
GitHub token           ``gh[pousr]_`` + 36+ alphanumerics, or ``github_pat_`` + 22+     ``ghp_...``
Hugging Face token     ``hf_`` + 30+ alphanumerics                                      ``hf_...``
Slack token            ``xox[abposr]-`` + 10+ of ``[A-Za-z0-9-]``                       ``xoxb-...``
Google API key         ``AIza`` + 35 of ``[0-9A-Za-z_-]``                               ``AIza...``
Stripe live key        ``[sr]k_live_`` + 16+ alphanumerics                              ``sk_live_...``
JSON web token         ``eyJ`` base64url ``.`` ``eyJ`` base64url ``.`` signature           ``eyJhbGci...``
=====================  ===========================================================  =============================

Word starts are enforced with a lookbehind (not ``\b``, which would split ``sk-`` keys at the hyphen).
Deliberately absent: a 40-hex-digit pattern (W&B keys; git commit hashes in ``run_metadata.json`` have
that shape) and a generic ``password: value`` assignment (``run_metadata.json`` maps ``extra.api_key`` to
its source, ``"override"``, which such a pattern cannot tell from a password). Secret config values
never get that far: the writer redacts them (``run.redaction``). A well-kept library (detect-secrets) was considered: its OpenAI detector requires the
``T3BlbkFJ`` marker of one key generation and misses ``sk-`` keys of other shapes, and its entropy
detectors flag every sha256 in a checkpoint manifest, so a documented list fits a run directory better.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_START = rb"(?<![A-Za-z0-9_\-])"  # a token starts at a word start; "-" counts as inside a token
PATTERNS: dict[str, re.Pattern[bytes]] = {
    "private key": re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"),
    "OpenAI-style API key (sk-...)": re.compile(_START + rb"sk-(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{8,}"),
    "AWS access key id": re.compile(_START + rb"(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Za-z])"),
    "GitHub token": re.compile(_START + rb"(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
    "Hugging Face token": re.compile(_START + rb"hf_[A-Za-z0-9]{30,}"),
    "Slack token": re.compile(_START + rb"xox[abposr]-[A-Za-z0-9\-]{10,}"),
    "Google API key": re.compile(_START + rb"AIza[0-9A-Za-z_\-]{35}"),
    "Stripe live key": re.compile(_START + rb"[sr]k_live_[0-9A-Za-z]{16,}"),
    "JSON web token": re.compile(_START + rb"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
}
_CHUNK = 1 << 20
_OVERLAP = 4096  # longer than any match we report: a token split across two chunks is still found


@dataclass(frozen=True)
class Finding:
    """A secret-shaped string: where it is (1-based line) and which pattern it matched; never the value."""

    path: str
    line: int
    kind: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}"


def scan_file(path: Path, rel: str) -> list[Finding]:
    """Every pattern match in ``path`` (reported as ``rel``), at most one per line and kind, in line order.

    Binary files are scanned too (a key can hide in any file); the file is read in overlapping chunks, so
    its size does not matter. Symlinks are refused (``O_NOFOLLOW``) like everywhere in the run tools.
    """
    found: dict[tuple[int, str], Finding] = {}
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    with open(os.open(path, os.O_RDONLY | nofollow), "rb") as handle:
        offset_lines, tail = 1, b""  # line number at the start of `tail`
        while True:
            block = handle.read(_CHUNK)
            window = tail + block
            for kind, pattern in PATTERNS.items():
                for match in pattern.finditer(window):
                    # Matches wholly inside the carried-over tail were reported with the previous window.
                    if block and match.end() <= len(tail):
                        continue
                    line = offset_lines + window.count(b"\n", 0, match.start())
                    found.setdefault((line, kind), Finding(rel, line, kind))
            if not block:
                break
            keep = window[-_OVERLAP:] if len(window) > _OVERLAP else window
            offset_lines += window.count(b"\n", 0, len(window) - len(keep))
            tail = keep
    return sorted(found.values(), key=lambda f: (f.line, f.kind))
