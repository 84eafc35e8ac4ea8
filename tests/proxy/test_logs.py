"""Log formats: JSON lines carry ``extra`` fields as keys; text lines append them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from proxy.logs import configure


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield out
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def test_json_line_has_the_standard_keys_and_extras(stream: io.StringIO) -> None:
    configure("info", "json", stream=stream)
    log = logging.LoggerAdapter(logging.getLogger("omni_sidecar.test"), {"session": "sess_1"})
    log.info("closed %s", "cleanly")
    logging.getLogger("omni_sidecar.access").warning(
        "rejected", extra={"session": "sess_2", "client": "10.0.0.1", "event": "handshake"}
    )
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["level"] == "info"
    assert first["logger"] == "omni_sidecar.test"
    assert first["message"] == "closed cleanly"
    assert first["session"] == "sess_1"
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert (second["level"], second["message"]) == ("warning", "rejected")
    assert (second["session"], second["client"], second["event"]) == (
        "sess_2", "10.0.0.1", "handshake",
    )  # fmt: skip


def test_json_keeps_one_line_per_record_with_a_traceback(stream: io.StringIO) -> None:
    configure("info", "json", stream=stream)
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logging.getLogger("x").exception("engine: failed")
    (line,) = stream.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["message"] == "engine: failed"
    assert "ValueError: boom" in entry["exc_info"]


def test_text_appends_extras(stream: io.StringIO) -> None:
    configure("info", "text", stream=stream)
    logging.getLogger("omni_sidecar").info("session end", extra={"session": "sess_2"})
    line = stream.getvalue().strip()
    assert line.endswith("INFO omni_sidecar: session end session=sess_2")


def test_configure_again_replaces_level_and_format(stream: io.StringIO) -> None:
    configure("info", "text", stream=stream)
    configure("warning", "json", stream=stream)
    logging.getLogger("a").info("hidden")
    logging.getLogger("a").warning("shown")
    lines = stream.getvalue().splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["shown"]
