"""The secret resume tokens are bound with (``resume_secret_file``; docs/design.md, Resume).

Every sidecar in front of the same engines reads the same file, so a token one
of them issued verifies on any other; a missing file is created with a random
secret (mode 0600, never overwritten), so a single host keeps its secret across
restarts without a step of its own.
"""

from __future__ import annotations

import os
import secrets
from typing import Final

__all__ = ["MIN_SECRET_BYTES", "load_resume_secret"]

#: The shortest secret accepted (128 bits).
MIN_SECRET_BYTES: Final = 16
#: What a created file holds: 32 random bytes, hex (a text file an operator can copy).
_CREATED_BYTES: Final = 32


def load_resume_secret(path: str | None) -> bytes:
    """The secret from ``path`` (created when missing); a random one per process when unset.

    Raises:
        ValueError: the file is shorter than ``MIN_SECRET_BYTES`` or cannot be read
            or created; the message says which.
    """
    if path is None:
        return secrets.token_bytes(_CREATED_BYTES)
    if not os.path.exists(path):
        _create(path)
    try:
        with open(path, "rb") as file:
            secret = file.read(64 * 1024).strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{path} holds {len(secret)} bytes; a resume secret needs at least {MIN_SECRET_BYTES}"
        )
    return secret


def _create(path: str) -> None:
    """Write a random secret to ``path`` unless another process got there first: the
    file appears whole or not at all (written aside, then linked into place)."""
    spare = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(_CREATED_BYTES).encode() + b"\n")
        finally:
            os.close(fd)
        try:
            os.link(spare, path)
        except FileExistsError:
            pass  # another sidecar created it: its secret wins
        finally:
            os.unlink(spare)
    except OSError as exc:
        raise ValueError(f"cannot create {path}: {exc.strerror}") from None
