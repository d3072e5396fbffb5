"""Reading a document from a file or stdin, with one clear error for each way it can be unusable.

Text is UTF-8 (a UTF-8 byte-order mark is dropped), or UTF-16 / UTF-32 when the file starts with
their byte-order mark. A NUL character anywhere in the text marks a binary file.
"""

from __future__ import annotations

import codecs
import sys
from pathlib import Path
from typing import BinaryIO

from .errors import InputError

# Longest marks first: UTF-32-LE's mark begins with UTF-16-LE's.
BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def decode_text(data: bytes, label: str) -> str:
    """The text in ``data``; ``label`` names the source in errors (a path or 'stdin')."""
    encoding = next((enc for bom, enc in BOMS if data.startswith(bom)), "utf-8")
    if encoding == "utf-8" and b"\x00" in data:
        raise InputError(f"{label}: looks like a binary file (NUL bytes), not text")
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        name = encoding.removesuffix("-sig").upper()
        raise InputError(
            f"{label}: not {name} text (invalid byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None
    if "\x00" in text:
        raise InputError(f"{label}: looks like a binary file (NUL characters), not text")
    if not text.strip():
        raise InputError(f"{label}: is empty")
    return text


def read_document(source: str, stdin: BinaryIO | None = None) -> str:
    """Read ``source`` (a path, or ``-`` for stdin) as text."""
    if source == "-":
        if stdin is None:
            if sys.stdin is None:  # started with stdin closed (`<&-`)
                raise InputError("stdin is closed: give FILE, or pipe the document in")
            stdin = sys.stdin.buffer
        return decode_text(stdin.read(), "stdin")
    path = Path(source)
    if not path.exists():
        raise InputError(f"{source}: no such file")
    if path.is_dir():
        raise InputError(f"{source}: is a directory, not a file")
    try:
        data = path.read_bytes()
    except PermissionError:
        raise InputError(f"{source}: permission denied") from None
    except OSError as exc:
        raise InputError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    return decode_text(data, source)
