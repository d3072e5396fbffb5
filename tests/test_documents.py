"""Reading documents: each unusable input is one clear InputError."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from icecache.documents import read_document
from icecache.errors import InputError


def test_reads_utf8_file_and_stdin(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("Grüße aus Kessel Bay.\n", encoding="utf-8")
    assert read_document(str(p)) == "Grüße aus Kessel Bay.\n"
    assert read_document("-", stdin=io.BytesIO(b"from a pipe")) == "from a pipe"


def test_utf8_bom_is_dropped(tmp_path):
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbfhello")
    assert read_document(str(p)) == "hello"


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: d, "is a directory"),
        (lambda d: _write(d / "empty.txt", b""), "is empty"),
        (lambda d: _write(d / "blank.txt", b"  \n\t\n"), "is empty"),
        (lambda d: _write(d / "bin.dat", b"\x7fELF\x00\x01\x02"), "binary file"),
        (lambda d: _write(d / "latin1.txt", "café".encode("latin-1")), "not UTF-8 text (invalid byte 0xe9 at offset 3)"),
    ],
)
def test_bad_files(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(InputError) as info:
        read_document(str(path))
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_unreadable_file(tmp_path, monkeypatch):
    p = _write(tmp_path / "secret.txt", b"text")

    def deny(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(InputError, match="secret.txt: permission denied"):
        read_document(str(p))


def test_empty_stdin():
    with pytest.raises(InputError, match="stdin: is empty"):
        read_document("-", stdin=io.BytesIO(b""))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
