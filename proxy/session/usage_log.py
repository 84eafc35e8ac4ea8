"""Where a session's usage record goes when it ends (docs/design.md, Usage).

The record itself is computed by the I/O-free core (proxy/core/usage.py).
:class:`UsageBook` counts it per key name, keeps per-name totals for the
console, and hands it to :class:`UsageFile` when ``usage_file`` is set: JSON
lines written by a thread of its own, behind a bounded queue, rotated.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from metrics import SidecarMetrics
from proxy.core.usage import AudioDirection, ResponseOutcome, UsageRecord

__all__ = ["FAILURE_LOG_INTERVAL", "UsageBook", "UsageFile"]

log = logging.getLogger(__name__)

_STOP: Final = None
#: Seconds between two warnings about records the usage file could not take.
FAILURE_LOG_INTERVAL: Final = 60.0


class UsageFile:
    """A bounded, rotated JSONL file written by one thread.

    Args:
        path: the file (created when missing, appended to).
        max_bytes: rotate before a line would take the file past this size.
        backups: rotated files kept (``path.1`` newest); 0 = truncate instead.
        max_pending: lines queued for the writer; beyond it :meth:`put` drops.
        on_failure: called (from the writer thread) for each line not written.
        clock: monotonic seconds, for the failure lines' rate (tests inject one).
    """

    def __init__(
        self,
        path: str,
        *,
        max_bytes: int,
        backups: int,
        max_pending: int,
        on_failure: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._on_failure = on_failure
        self._clock = clock
        #: Records lost since the last line said so, and since writes last worked.
        self._lost_unreported = 0
        self._lost = 0
        #: When the last failure line was logged (None: writes work).
        self._warned_at: float | None = None
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="omni-sidecar-usage", daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> bool:
        """Queue one record; False (dropped) when the writer is ``max_pending`` behind."""
        try:
            self._queue.put_nowait(orjson.dumps(record) + b"\n")
        except queue.Full:
            return False
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued (up to ``timeout`` seconds), then stop the thread."""
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=timeout)
        self._thread.join(timeout)

    def _run(self) -> None:
        handle = None
        size = 0  # bytes in the current file (counted: tell() fails on a pipe)
        try:
            while True:
                line = self._queue.get()
                if line is None:
                    if self._lost_unreported:
                        log.warning(
                            "usage file %s: %d records lost since the last warning, "
                            "%d in all, when the writer stopped",
                            self.path,
                            self._lost_unreported,
                            self._lost,
                        )
                    return
                try:
                    if handle is None:
                        handle = open(self.path, "ab")  # noqa: SIM115 - kept open across lines
                        size = os.fstat(handle.fileno()).st_size
                    if size and size + len(line) > self.max_bytes:
                        handle.close()
                        handle = None
                        self._rotate()
                        handle = open(self.path, "ab")  # noqa: SIM115
                        size = 0
                    handle.write(line)
                    handle.flush()
                    size += len(line)
                    if self._warned_at is not None:
                        self._recovered()
                except OSError as exc:
                    self._on_failure()
                    self._failed(exc)
                    if handle is not None:
                        with contextlib.suppress(OSError):
                            handle.close()
                        handle = None
        finally:
            if handle is not None:
                with contextlib.suppress(OSError):
                    handle.close()

    def _failed(self, exc: OSError) -> None:
        """One record lost: logged at once the first time, then at most once a minute."""
        self._lost += 1
        self._lost_unreported += 1
        now = self._clock()
        if self._warned_at is None:
            log.warning(
                "usage file %s: cannot write a record (%s); records are lost until it can "
                "(omni_sidecar_usage_records_dropped_total counts them; at most one more "
                "line a minute)",
                self.path,
                exc,
            )
        elif now - self._warned_at >= FAILURE_LOG_INTERVAL:
            log.warning(
                "usage file %s: still cannot write (%s): %d records lost since the last "
                "warning, %d in all",
                self.path,
                exc,
                self._lost_unreported,
                self._lost,
            )
        else:
            return
        self._warned_at = now
        self._lost_unreported = 0

    def _recovered(self) -> None:
        """A record was written after failures: say how many were lost in all."""
        log.warning(
            "usage file %s: writing again; %d records were lost (%d since the last warning)",
            self.path,
            self._lost,
            self._lost_unreported,
        )
        self._warned_at = None
        self._lost = self._lost_unreported = 0

    def _rotate(self) -> None:
        if self.backups <= 0:
            with open(self.path, "wb"):
                return
        for index in range(self.backups - 1, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{index + 1}")
        os.replace(self.path, f"{self.path}.1")


class UsageBook:
    """Per-key counters and totals, and the optional usage file.

    Args:
        metrics: the ``usage_*`` families; their ``key`` label is declared by
            :meth:`SidecarMetrics.set_usage_keys` from the key file.
        usage_file: the JSONL writer, or None when ``usage_file`` is unset.
    """

    def __init__(self, metrics: SidecarMetrics, usage_file: UsageFile | None = None) -> None:
        self._m = metrics
        self.file = usage_file
        #: key name → summed record fields, for the console (bounded by the declared names).
        self.totals: dict[str, dict[str, float]] = {}

    def add(self, record: UsageRecord, extra: dict[str, Any]) -> dict[str, Any]:
        """Count one ended session's record; returns its JSON fields (with ``extra``).

        Args:
            record: the core's record; its ``key`` is folded to ``unnamed``
                unless the name was declared from the key file.
            extra: fields identifying the session (its id, times), written first.
        """
        m = self._m
        key = m.usage_key(record.key)
        m.usage_sessions.labels(key).inc()
        m.usage_session_seconds.labels(key).inc(record.session_seconds)
        for direction in AudioDirection:
            seconds = record.audio_seconds[direction]
            if seconds > 0:
                m.usage_audio_seconds.labels(key, direction.value).inc(seconds)
        for outcome in ResponseOutcome:
            count = record.responses[outcome]
            if count:
                m.usage_responses.labels(key, outcome.value).inc(count)
        if record.input_tokens:
            m.usage_tokens.labels(key, "input").inc(record.input_tokens)
        if record.output_tokens:
            m.usage_tokens.labels(key, "output").inc(record.output_tokens)
        fields = record.fields()
        fields["key"] = key
        total = self.totals.setdefault(key, {})
        total["sessions"] = total.get("sessions", 0) + 1
        for name, value in fields.items():
            if name != "key":
                total[name] = total.get(name, 0) + value
        line = {**extra, **fields}
        if self.file is not None and not self.file.put(line):
            m.usage_records_dropped.inc()
        return line

    def view(self) -> list[dict[str, Any]]:
        """Totals per key name for the console, sorted by name."""
        return [
            {"key": key, **{k: round(v, 3) for k, v in total.items()}}
            for key, total in sorted(self.totals.items())
        ]

    def close(self, timeout: float) -> None:
        """Flush and stop the usage file's writer (blocking; call it off the event loop)."""
        if self.file is not None:
            self.file.close(timeout)
