"""Log output: ``--log-format text|json`` and ``--log-level``, settable again on reload.

Text lines or one JSON object per line, each ``extra`` field a caller attached
(``session``, ``client``, ...) shown as ``key=value`` or as a key of its own;
messages are never rewritten. :func:`configure` replaces the handler it
installed before, so a SIGHUP never duplicates lines. docs/design.md, Logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Final, TextIO

__all__ = ["JsonFormatter", "TextFormatter", "configure", "extra_fields"]

#: Attributes every ``LogRecord`` has; anything else on a record came from ``extra``.
_RECORD_ATTRIBUTES: Final = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))
) | {"message", "asctime", "taskName"}

_TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """Return the fields a caller attached with ``extra=`` (in insertion order)."""
    return {
        key: value
        for key, value in vars(record).items()
        if key not in _RECORD_ATTRIBUTES and not key.startswith("_")
    }


class TextFormatter(logging.Formatter):
    """The classic text line, with ``extra`` fields appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = extra_fields(record)
        if not extras:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback below the fields
        fields = " ".join(f"{key}={value}" for key, value in extras.items())
        return f"{head} {fields}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = record.created
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        entry: dict[str, object] = {
            "ts": f"{stamp}.{int(seconds % 1 * 1000):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extra_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        # default=str: an extra that is not JSON (an enum, a path) still logs.
        return json.dumps(entry, ensure_ascii=False, default=str)


_installed: list[logging.Handler] = []


def configure(level: str, fmt: str, *, stream: TextIO | None = None) -> None:
    """Send log records at ``level`` and above to ``stream`` (stderr) as ``fmt``.

    Args:
        level: ``debug`` ... ``critical`` (the ``log_level`` setting).
        fmt: ``text`` or ``json`` (the ``log_format`` setting).
        stream: Where lines go; stderr by default.
    """
    root = logging.getLogger()
    for handler in _installed:
        root.removeHandler(handler)
    _installed.clear()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    _installed.append(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
