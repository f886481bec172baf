"""The forms in which a file can hold a key without its plain text: what the secret scan decodes.

``package`` refuses a key in plain text (``run.secret_scan``); the same key gzipped, base64-encoded or
written as UTF-16 would pass a scan of the raw bytes. So the scan also reads, for every file:

- **compressed streams**: a file that starts with the magic bytes of gzip, bzip2 or xz is decompressed,
  every member of a zip archive too (:func:`expanded`); inside a decoded view, the same for its bytes;
- **base64**: every run of at least ``MIN_BASE64`` base64 or base64url characters (line breaks and JSON's
  ``\\n`` allowed inside) is decoded at each of the four alignments, since a run cut out of a longer text
  may not start on a 4-character boundary, and scanned where it decodes to ``MIN_TEXT`` printable characters
  in a row or to a compressed stream (most runs are words, paths and digests, which decode to noise);
- **UTF-16**: where a window holds four printable ASCII characters in UTF-16 (either byte order: each
  beside a zero byte), its even and its odd bytes are read as text.

Both tests run on a translation of the window to character classes (``bytes.translate``, then a substring
search), so the many megabytes of tensors in a run directory cost a fast scan, not a regex.

Decoded views are scanned again, up to ``MAX_DEPTH`` forms deep (base64 of gzip of a key). Everything a
file expands to counts against one ``Budget`` of ``MAX_EXPANDED`` bytes: a decompression bomb ends the
decoding, and the scan reports the file as not scanned in full rather than passing it. (A UTF-16 reading is
half its window and takes nothing from the budget.)
"""

from __future__ import annotations

import binascii
import bz2
import lzma
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

MAX_EXPANDED = 256 << 20  # decoded bytes per file; a run directory holds no compressed data of its own
MAX_DEPTH = 3
MIN_BASE64 = 16  # the base64 of "sk-" and 8 characters, the shortest token shape
MIN_TEXT = 8  # printable characters in a row that make decoded base64 worth scanning (random bytes seldom hold 8)
_READ = 1 << 20
_BASE64_CHARS = rb"[A-Za-z0-9+/_\-]"
# A run, with line breaks (or JSON's two-character \n) between lines of at least 4 characters.
_BASE64_RUN = re.compile(_BASE64_CHARS + rb"{%d,}(?:(?:\r?\n|\\n)" % MIN_BASE64 + _BASE64_CHARS + rb"{4,})*={0,2}")
_BREAKS = re.compile(rb"\r|\n|\\n")
# Character classes: "b" a base64 character, "p" printable ASCII, "z" a zero byte, "." anything else.
_CLASSES = bytes(ord("b") if re.fullmatch(_BASE64_CHARS, bytes([i])) else ord("p") if 32 <= i < 127
                 else ord("z") if i == 0 else ord(".") for i in range(256))
_PRINTABLE = bytes(ord("p") if 32 <= i < 127 else ord("z") if i == 0 else ord(".") for i in range(256))
_URLSAFE = bytes.maketrans(b"-_", b"+/")
COMPRESSED: dict[bytes, tuple[str, Callable[[], Any]]] = {
    b"\x1f\x8b": ("gzip", lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)),
    b"BZh": ("bzip2", bz2.BZ2Decompressor),
    b"\xfd7zXZ\x00": ("xz", lzma.LZMADecompressor),
}
ZIP_MAGIC = b"PK\x03\x04"
LINELESS = ("base64",)  # forms whose line breaks are not the containing file's, nor the decompressed text's


@dataclass
class Budget:
    """Decoded bytes left for one file; ``exceeded`` once a decoder wanted more."""

    left: int = field(default_factory=lambda: MAX_EXPANDED)
    exceeded: bool = False

    def take(self, data: bytes) -> bytes:
        """``data`` as far as the budget reaches (all of it, or a prefix once it runs out)."""
        if len(data) > self.left:
            self.exceeded = True
            data = data[: self.left]
        self.left -= len(data)
        return data


def _decompressed(chunks: Iterator[bytes], make: Callable[[], Any], budget: Budget) -> Iterator[bytes]:
    """The decompressed chunks of a compressed stream (concatenated members too), within ``budget``; a corrupt
    stream ends where it stops decoding. Output is asked for in pieces, so a bomb never sits in memory."""
    decoder = make()
    for data in chunks:
        while True:
            if budget.left <= 0:
                budget.exceeded = True
                return
            if decoder.eof:  # another member may follow (`cat a.gz b.gz`)
                data, decoder = decoder.unused_data + data, make()
                if not data:
                    break
            try:
                out = decoder.decompress(data, min(_READ, budget.left + 1))
            except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError):
                return
            if out:
                yield budget.take(out)
            if decoder.eof:
                data = b""
                continue
            if hasattr(decoder, "needs_input"):  # bz2, lzma: they keep unread input themselves
                if decoder.needs_input:
                    break
                data = b""
            else:  # zlib hands unread input back
                data = decoder.unconsumed_tail
                if not data:
                    break


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def expanded(handle: IO[bytes], budget: Budget) -> Iterator[tuple[str, Iterator[bytes]]]:
    """``(form, decompressed chunks)`` of the file ``handle`` (at offset 0): one for a gzip, bzip2 or xz
    file, one per member of a zip archive, none for anything else."""
    head = handle.read(8)
    for magic, (form, make) in COMPRESSED.items():
        if head.startswith(magic):
            yield form, _decompressed(_chain(head, iter(lambda: handle.read(_READ), b"")), make, budget)
            return
    if head.startswith(ZIP_MAGIC):
        handle.seek(0)
        try:
            archive = zipfile.ZipFile(handle)
            members = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return
        for member in members:
            yield f"zip member {member.filename}", _zip_member(archive, member, budget)


def _zip_member(archive: zipfile.ZipFile, member: zipfile.ZipInfo, budget: Budget) -> Iterator[bytes]:
    try:
        with archive.open(member) as stream:
            while budget.left > 0 and (data := stream.read(min(_READ, budget.left + 1))):
                yield budget.take(data)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError,
            zlib.error, lzma.LZMAError):
        return


def _base64_views(data: bytes, budget: Budget) -> Iterator[tuple[int, str, bytes]]:
    if b"b" * MIN_BASE64 not in data.translate(_CLASSES):
        return
    for run in _BASE64_RUN.finditer(data):
        text = _BREAKS.sub(b"", run.group()).rstrip(b"=").translate(_URLSAFE)
        for start in range(4):
            piece = text[start:]
            piece = piece[: len(piece) - len(piece) % 4]
            if len(piece) < MIN_BASE64 or budget.left <= 0:
                continue
            try:
                decoded = binascii.a2b_base64(piece)
            except binascii.Error:
                continue
            # Most runs are words, paths and hashes, which decode to noise: skip what holds no text nor a stream.
            if b"p" * MIN_TEXT in decoded.translate(_PRINTABLE) or decoded.startswith(tuple(COMPRESSED)):
                yield run.start(), "base64", budget.take(decoded)


def _utf16_views(data: bytes) -> Iterator[tuple[int, str, bytes]]:
    # Half the window each, so no expansion to budget: a tensor file whose bytes happen to look like UTF-16
    # in every window must not end up "not scanned in full".
    if b"pzpzpzpz" in data.translate(_PRINTABLE):
        for start in (0, 1):
            yield 0, "UTF-16", data[start::2]


def views(data: bytes, budget: Budget, nested: bool) -> Iterator[tuple[int, str, bytes]]:
    """``(offset in data, form, decoded bytes)`` of what ``data`` holds in another form: its base64 runs,
    its UTF-16 reading, and, when ``nested`` (``data`` is itself a decoded view), its decompression where it
    starts with a compressed stream's magic bytes."""
    if nested:
        for magic, (form, make) in COMPRESSED.items():
            if data.startswith(magic):
                yield 0, form, b"".join(_decompressed(iter([data]), make, budget))
    yield from _base64_views(data, budget)
    yield from _utf16_views(data)
