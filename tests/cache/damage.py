"""Damage to a pool file, as a crash, a bad sector or a stray write leaves it: the SSD and fault tests share these."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of the byte at `offset`, as a bad sector or a stray write would."""
    with open(path, "r+b") as file:
        file.seek(offset)
        (byte,) = file.read(1)
        file.seek(offset)
        file.write(bytes([byte ^ 0xFF]))


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Write `data` over the file's bytes at `offset`."""
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def read_file(path: Path, offset: int, length: int) -> bytes:
    """`length` bytes of the file from `offset`."""
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length)
