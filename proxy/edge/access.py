"""The access line and usage record of each ended session (docs/design.md, Usage).

One line per session on logger ``omni_sidecar.access``, whatever its front
door (proxy/edge/session_open.py, proxy/edge/twilio_door.py).
"""

from __future__ import annotations

import logging
from typing import Final

from proxy.session.observer import SessionObserver
from proxy.session.relay import Relay
from proxy.session.usage_log import UsageBook

__all__ = ["access_log", "log_session_end"]

#: One line per ended session (and, from the edge, per refused handshake).
access_log = logging.getLogger("omni_sidecar.access")


def log_session_end(
    relay: Relay, observer: SessionObserver, usage: UsageBook, front_door: str = ""
) -> None:
    """One access line per session (logger ``omni_sidecar.access``), with its usage.

    The usage record (docs/design.md, Usage) is counted per key name and, with
    ``usage_file``, written as one JSON line (with ``front_door`` for a phone call).
    """
    view = relay.view
    now = relay.timers.now()
    duration = now - relay.started_at
    record = usage.add(
        view.usage_record(observer.key_name, duration, now),
        {
            "ts": round(observer.started_at + duration, 3),
            "session": relay.key,
            "engine_session": view.session_id or "-",
            "started_at": round(observer.started_at, 3),
            **({"front_door": front_door} if front_door else {}),
        },
    )
    outcome = view.outcome.value if view.outcome is not None else "error"
    sent = relay.side.writer.close_code_sent
    drops = {r.value: e for r, (e, _b) in view.drop_totals().items() if e}
    fields = {
        "session": relay.key,
        "engine_session": view.session_id or "-",
        "client": observer.client_address or "-",
        "duration_s": round(duration, 3),
        "events_in": observer.events_client_to_upstream,
        "bytes_in": observer.c2u_bytes,
        "events_out": relay.side.frames_written,
        "bytes_out": relay.side.bytes_written,
        "attachments": relay.side.attachment,
        "drops": ",".join(f"{k}:{v}" for k, v in sorted(drops.items())) or "none",
        "outcome": outcome,
        # The code the client actually got; "not_sent" when no close frame reached it.
        "close_code": sent if sent is not None else "not_sent",
    }
    for name in _USAGE_FIELDS:
        fields[name] = record[name]
    # The fields ride as extras: text logs append them as key=value, JSON logs
    # give each a key of its own.
    access_log.info("session end", extra=fields)


#: The usage record's fields the access line carries (the record's identity fields it has already).
_USAGE_FIELDS: Final = (
    "key",
    "audio_in_seconds",
    "audio_out_seconds",
    "audio_delivered_seconds",
    "audio_heard_seconds",
    "responses_started",
    "responses_completed",
    "responses_cancelled",
    "responses_failed",
    "responses_incomplete",
    "responses_unfinished",
    "input_tokens",
    "output_tokens",
    "total_tokens",
)
