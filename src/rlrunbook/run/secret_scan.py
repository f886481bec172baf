r"""A content scan for secrets: private keys, common API token shapes and URL credentials, by file and line.

``rlrunbook package`` refuses a run directory in which this finds anything (``--allow-secrets`` overrides),
and the writer withholds a config value it matches (``run.redaction.credential_kind``). It complements the
scan for the values of secret environment variables (``run.tools.find_secrets``), which only knows what
is set in the current shell. The patterns, and why each is safe to search for in a run directory (whose
files hold hex digests, token ids, floats and model text):

=====================  ===========================================================  =============================
name                   pattern                                                      example shape
=====================  ===========================================================  =============================
private key            ``-----BEGIN [A-Z ]*PRIVATE KEY( BLOCK)?-----``                 PEM / OpenSSH / PGP key files,
                                                                                    a service account's JSON
PuTTY private key      ``PuTTY-User-Key-File-<n>:``                                     ``*.ppk``
OpenAI-style key       ``sk-`` (``sk-proj-``, ``sk-ant-``...) then 8+ of ``[A-Za-z0-9_-]``  ``sk-...``, Anthropic
                       with at least one digit, at a word start
AWS access key id      ``(AKIA|ASIA)`` + 16 of ``[0-9A-Z]``                              ``AKIA...``
AWS secret access key  ``aws_secret_access_key`` (any case, ``_`` optional), ``=`` or    ``~/.aws/credentials``
                       ``:``, then 40 of ``[A-Za-z0-9/+]``
GitHub token           ``gh[pousr]_`` + 36+ alphanumerics, or ``github_pat_`` + 22+     ``ghp_...``
GitLab token           ``glpat-`` + 20+ of ``[A-Za-z0-9_-]``                             ``glpat-...``
Hugging Face token     ``hf_`` + 30+ alphanumerics                                      ``hf_...``
Slack token            ``xox[abposr]-`` + 10+ of ``[A-Za-z0-9-]``                       ``xoxb-...``
Slack webhook          ``https://hooks.slack.com/(services|workflows|triggers)/...``    an incoming webhook URL
Google API key         ``AIza`` + 35 of ``[0-9A-Za-z_-]``                               ``AIza...``
Stripe live key        ``[sr]k_live_`` + 16+ alphanumerics                              ``sk_live_...``
npm token              ``npm_`` + 36 alphanumerics                                      ``.npmrc``
PyPI token             ``pypi-AgE`` + 50+ of ``[A-Za-z0-9_-]``                           ``.pypirc``
Tinker API key         ``tml-`` + 20+ of ``[A-Za-z0-9_-]`` with a digit                  ``TINKER_API_KEY``
JSON web token         ``eyJ`` base64url ``.`` ``eyJ`` base64url ``.`` signature           ``eyJhbGci...``
URL with credentials   ``scheme://user:password@`` (a non-empty password)               ``.git-credentials``, a
                                                                                    database or proxy URL
=====================  ===========================================================  =============================

Word starts are enforced with a lookbehind (not ``\b``, which would split ``sk-`` keys at the hyphen).
Deliberately absent: a 40-hex-digit pattern (W&B keys; git commit hashes in ``run_metadata.json`` have
that shape) and a generic ``password: value`` assignment (``run_metadata.json`` maps ``extra.api_key`` to
its source, ``"override"``, which such a pattern cannot tell from a password). Secret config values
never get that far: the writer redacts them (``run.redaction``). A well-kept library (detect-secrets) was
considered: its OpenAI detector requires the ``T3BlbkFJ`` marker of one key generation and misses ``sk-``
keys of other shapes, and its entropy detectors flag every sha256 in a checkpoint manifest, so a documented
list fits a run directory better.

A key is found in the forms a file can hold it in, not only as plain text (``run.secret_forms``):
gzip, bzip2 and xz streams and zip members are decompressed (up to ``MAX_EXPANDED`` bytes a file),
base64 runs are decoded, UTF-16 text is read; a finding there names the form, e.g.
``notes.txt.gz:3: private key (in gzip)``.

Names are scanned too (:func:`scan_name`), with the same patterns and forms: a file or directory called
``sk-proj-....txt`` would put its key into an archive's member list and its manifest. In a name, each part
after a ``-``, ``_`` or ``.`` is also read as a word start (``run-sk-proj-...`` is a key after a separator,
where in a file's text ``-`` continues a token). A path is shown with such names redacted (:func:`redact_path`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.run import secret_forms
from rlrunbook.run.jsonio import REDACTED

_WORD = rb"[A-Za-z0-9_\-]"  # a token starts at a word start; "-" counts as inside a token


def _token(prefix: bytes, rest: bytes) -> re.Pattern[bytes]:
    """``prefix`` at a word start, then ``rest``. The word-start test is a lookbehind placed after the literal
    prefix: a pattern that starts with a literal is searched for with a fast scan (a leading lookbehind made
    the scan of a run directory about 50 times slower)."""
    return re.compile(prefix + rb"(?<!" + _WORD + prefix + rb")" + rest)


URL_CREDENTIALS = "URL with credentials"
PATTERNS: dict[str, re.Pattern[bytes]] = {
    "private key": re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"),
    "PuTTY private key": re.compile(rb"PuTTY-User-Key-File-\d+:"),
    "OpenAI-style API key (sk-...)": _token(rb"sk-", rb"(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{8,}"),
    "AWS access key id": _token(rb"A[KS]IA", rb"[0-9A-Z]{16}(?![0-9A-Za-z])"),
    "AWS secret access key": re.compile(rb"(?i:aws_?secret_?(?:access_?)?key)[\"']?\s{0,4}[:=]\s{0,4}[\"']?"
                                        rb"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"),
    "GitHub token": _token(rb"g", rb"(?:h[pousr]_[A-Za-z0-9]{36,}|ithub_pat_[A-Za-z0-9_]{22,})"),
    "GitLab token": _token(rb"glpat-", rb"[A-Za-z0-9_\-]{20,}"),
    "Hugging Face token": _token(rb"hf_", rb"[A-Za-z0-9]{30,}"),
    "Slack token": _token(rb"xox", rb"[abposr]-[A-Za-z0-9\-]{10,}"),
    "Slack webhook": re.compile(rb"hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9_/\-]{16,}"),
    "Google API key": _token(rb"AIza", rb"[0-9A-Za-z_\-]{35}"),
    "Stripe live key": _token(rb"[sr]k_live_", rb"[0-9A-Za-z]{16,}"),
    "npm token": _token(rb"npm_", rb"[A-Za-z0-9]{36}(?![A-Za-z0-9])"),
    "PyPI token": _token(rb"pypi-AgE", rb"[A-Za-z0-9_\-]{50,}"),
    "Tinker API key": _token(rb"tml-", rb"(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{20,}"),
    "JSON web token": _token(rb"eyJ", rb"[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    # group 1: the userinfo (what is redacted), so the scheme and the host stay readable
    URL_CREDENTIALS: re.compile(rb"://([^\s/:@\"'<>\\]*:[^\s/@\"'<>\\]+)@"),
}
# Patterns without a literal start are searched for only where one of these literals occurs (a fast scan).
PREFILTERS: dict[str, tuple[bytes, ...]] = {"AWS secret access key": (b"ecret", b"ECRET"),
                                            "Stripe live key": (b"k_live_",)}
_CHUNK = 1 << 20
_OVERLAP = 4096  # longer than any match we report: a token split across two chunks is still found


@dataclass(frozen=True)
class Finding:
    """A secret-shaped string: where it is (1-based line; 0 for the file as a whole) and which pattern it
    matched; never the value."""

    path: str
    line: int
    kind: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}" if self.line else f"{self.path}: {self.kind}"


def matches(data: bytes) -> Iterator[tuple[re.Match[bytes], str]]:
    """Every pattern match in ``data`` with its kind, pattern by pattern."""
    for kind, pattern in PATTERNS.items():
        if kind in PREFILTERS and not any(literal in data for literal in PREFILTERS[kind]):
            continue
        for match in pattern.finditer(data):
            yield match, kind


class _Scan:
    """The findings of one file: every window of every form it holds goes through :meth:`window`."""

    def __init__(self, rel: str, needles: Mapping[str, Iterable[bytes]]):
        self.rel, self.needles = rel, needles
        self.found: dict[tuple[int, str], Finding] = {}
        self.budget = secret_forms.Budget()

    def add(self, line: int, kind: str, forms: tuple[str, ...]) -> None:
        kind = f"{kind} (in {', '.join(forms)})" if forms else kind
        self.found.setdefault((line, kind), Finding(self.rel, line, kind))

    def window(self, data: bytes, first_line: int, forms: tuple[str, ...], depth: int, lines: bool = True) -> None:
        """Report what ``data`` holds (its first line is ``first_line``), then what its decoded views hold,
        one level deeper. A match seen again in the overlap of two windows has the same line: kept once.
        Without ``lines`` (decoded base64, whose line breaks are not the file's) every finding gets
        ``first_line``, the line where the encoded text starts."""
        def line_of(offset: int) -> int:
            return first_line + data.count(b"\n", 0, offset) if lines else first_line

        for match, kind in matches(data):
            self.add(line_of(match.start()), kind, forms)
        if forms:  # values in plain form are found by run.tools, in the file's own format
            for name, values in self.needles.items():
                at = min((i for i in (data.find(v) for v in values) if i >= 0), default=-1)
                if at >= 0:
                    self.add(line_of(at), name, forms)
        if depth < secret_forms.MAX_DEPTH:
            for offset, form, view in secret_forms.views(data, self.budget, nested=depth > 0):
                self.window(view, line_of(offset), (*forms, form), depth + 1,
                            lines=lines and form not in secret_forms.LINELESS)

    def stream(self, chunks: Iterable[bytes], forms: tuple[str, ...], depth: int) -> None:
        """Scan a byte stream in overlapping windows, so a token split across two chunks is still found."""
        first_line, tail = 1, b""
        for block in chunks:
            window = tail + block
            self.window(window, first_line, forms, depth)
            keep = window[-_OVERLAP:]
            first_line += window.count(b"\n", 0, len(window) - len(keep))
            tail = keep


def scan_file(path: Path, rel: str, needles: Mapping[str, Iterable[bytes]] | None = None) -> list[Finding]:
    """Every pattern match in ``path`` (reported as ``rel``), at most one per line and kind, in line order.

    Binary files are scanned too (a key can hide in any file); the file is read in overlapping chunks, so
    its size does not matter. Compressed content is scanned decompressed, base64 runs decoded and UTF-16
    text read (``run.secret_forms``); ``needles`` (``{variable: its values as bytes}``) are sought there too.
    Symlinks are refused (``O_NOFOLLOW``) like everywhere in the run tools.
    """
    scan = _Scan(rel, needles or {})
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    with open(os.open(path, os.O_RDONLY | nofollow), "rb") as handle:
        scan.stream(iter(lambda: handle.read(_CHUNK), b""), (), 0)
        handle.seek(0)
        for form, chunks in secret_forms.expanded(handle, scan.budget):
            scan.stream(chunks, (form,), 1)
    if scan.budget.exceeded:
        scan.add(0, f"decoded content over {secret_forms.MAX_EXPANDED >> 20} MiB, not scanned in full", ())
    return sorted(scan.found.values(), key=lambda f: (f.line, f.kind))


NAME_SEPARATORS = b"-_."  # in a name, a token may start after any of these (see the module docstring)


def name_matches(name: bytes) -> Iterator[tuple[int, int, str]]:
    """``(start, end, kind)`` of every pattern match in one file or directory name (no ``/``), each part after a
    ``-``, ``_`` or ``.`` read as a word start too; of a URL, the span of its ``user:password``."""
    for start in [0] + [i + 1 for i, byte in enumerate(name) if byte in NAME_SEPARATORS]:
        for match, kind in matches(name[start:]):
            low, high = match.span(1) if kind == URL_CREDENTIALS else match.span()
            yield start + low, start + high, kind


def _name_bytes(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")  # os.walk's str for a name that is not UTF-8


def scan_name(name: str, needles: Mapping[str, Iterable[bytes]] | None = None) -> list[str]:
    """The kinds of secret one file or directory ``name`` holds (no ``/``), sorted: the patterns
    (:func:`name_matches`), the same in the forms of ``run.secret_forms`` (base64, UTF-16: ``... (in base64)``),
    and the variable of each ``needles`` value (``{variable: its values as bytes}``) it contains."""
    data = _name_bytes(name)
    kinds = {kind for _, _, kind in name_matches(data)}
    kinds |= {variable for variable, values in (needles or {}).items() if any(v and v in data for v in values)}
    for start in [0] + [i + 1 for i, byte in enumerate(data) if byte in NAME_SEPARATORS]:
        scan = _Scan(name, needles or {})
        for _, form, view in secret_forms.views(data[start:], scan.budget, nested=False):
            scan.window(view, 0, (form,), 1, lines=False)
        kinds |= {finding.kind for finding in scan.found.values()}
    return sorted(kinds)


def redact_name(name: str, needles: Mapping[str, Iterable[bytes]] | None = None) -> str:
    """``name`` with each secret in it replaced by ``REDACTED`` (``<redacted>.txt``); a name whose secret is found
    only in another form (base64 of a key) is replaced whole. Names holding none come back unchanged."""
    if not scan_name(name, needles):
        return name
    data = _name_bytes(name)
    spans = [(low, high) for low, high, _ in name_matches(data)]
    for values in (needles or {}).values():
        for value in values:
            at = data.find(value) if value else -1
            while at >= 0:
                spans.append((at, at + len(value)))
                at = data.find(value, at + 1)
    out, at = [], 0
    for low, high in sorted(spans):
        if low >= at:
            out += [data[at:low], REDACTED.encode()]
        at = max(at, high)
    redacted = b"".join([*out, data[at:]]).decode("utf-8", "surrogateescape")
    return redacted if redacted != name and not scan_name(redacted, needles) else REDACTED


def redact_path(rel: str, needles: Mapping[str, Iterable[bytes]] | None = None) -> str:
    """The relative path ``rel`` with every name in it passed through :func:`redact_name`."""
    return "/".join(redact_name(part, needles) for part in rel.split("/"))
