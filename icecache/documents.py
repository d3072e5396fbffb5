"""Reading a document from a file or stdin, with one clear error for each way it can be unusable."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

from .errors import InputError

BINARY_SNIFF_BYTES = 8192


def decode_text(data: bytes, label: str) -> str:
    """UTF-8 text from ``data``; ``label`` names the source in errors (a path or 'stdin')."""
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        raise InputError(f"{label}: looks like a binary file (NUL bytes), not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{label}: not UTF-8 text (invalid byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None
    if not text.strip():
        raise InputError(f"{label}: is empty")
    return text


def read_document(source: str, stdin: BinaryIO | None = None) -> str:
    """Read ``source`` (a path, or ``-`` for stdin) as UTF-8 text."""
    if source == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        return decode_text(stream.read(), "stdin")
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
