"""``image_size``: an image file's size from its header, as ``Image.open`` gives it, with its errors."""

from __future__ import annotations

import struct
import zlib

import pytest
from PIL import Image

from extract.models.inputs import image_size


@pytest.mark.parametrize(("mode", "fmt"), [("RGB", "PNG"), ("P", "PNG"), ("L", "PNG"), ("RGBA", "PNG"),
                                           ("RGB", "JPEG"), ("RGB", "BMP")])
def test_the_size_is_pils(tmp_path, mode, fmt):
    path = tmp_path / f"a.{fmt.lower()}"
    Image.new(mode, (37, 19)).save(path, format=fmt)
    with Image.open(path) as im:
        assert image_size(path) == im.size == (37, 19)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, *, before_data: bytes = b"") -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (its pixels need not match: PIL's open never reads them)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + before_data + _chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + _chunk(b"IEND", b""))


def test_a_bomb_is_refused_where_pil_refuses_it(tmp_path):
    path = tmp_path / "bomb.png"
    path.write_bytes(_png(60000, 60000))
    with pytest.raises(Image.DecompressionBombError, match="exceeds limit") as ours:
        image_size(path)
    with pytest.raises(Image.DecompressionBombError) as pils:
        Image.open(path)
    assert str(ours.value) == str(pils.value)
    path.write_bytes(_png(10000, 10000))  # past the warning limit, not the refusal's: a size
    assert image_size(path) == (10000, 10000)


def test_chunks_before_the_image_data_are_read(tmp_path):
    path = tmp_path / "text.png"
    path.write_bytes(_png(30, 20, before_data=_chunk(b"tEXt", b"Comment\0hello")))
    assert image_size(path) == (30, 20)


_GOOD = _png(30, 20)
_BROKEN = {
    "empty": b"",
    "signature only": _GOOD[:8],
    "not an image": b"not an image at all, not at all",
    "zero width": _png(0, 5),
    "cut in its header": _GOOD[:20],
    "cut before its data": _GOOD[:33],
    "header CRC wrong": _GOOD[:29] + bytes([_GOOD[29] ^ 1]) + _GOOD[30:],
}


@pytest.mark.parametrize("name", list(_BROKEN))
def test_a_header_pil_refuses_is_refused(tmp_path, name):
    path = tmp_path / "bad.png"
    path.write_bytes(_BROKEN[name])
    with pytest.raises((OSError, SyntaxError)):
        Image.open(path)  # the reference: PIL refuses it too
    with pytest.raises((OSError, SyntaxError)):
        image_size(path)


@pytest.mark.parametrize("cut", [16, 33])
def test_a_cut_file_says_what_pil_says(tmp_path, cut):
    """The pre-run check's error is what users saw from PIL (docs/reliability.md quotes it)."""
    path = tmp_path / "cut.png"
    path.write_bytes(_GOOD[:cut])
    with pytest.raises(OSError, match="^Truncated File Read$"):
        image_size(path)


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        image_size(tmp_path / "nope.png")
