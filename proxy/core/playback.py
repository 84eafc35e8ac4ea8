"""The playback ledger: what a client was sent and has heard, per response item.

One per session, sans-I/O (docs/design.md, Playback): pacing to real time plus
``max_audio_lead``, the heard estimate, ``playback.ack`` on the client's
behalf, truncation on interrupt, the engine's answers matched by order
(``MAX_OUTSTANDING`` in flight, ``ANSWER_TIMEOUT``), and no acks for
non-duplex sessions.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import orjson

from proxy.core.capabilities import EngineCapabilities, EngineVersion
from proxy.core.engine_releases import WireSign, shown_by
from proxy.core.events import UpstreamEvent
from proxy.core.playback_state import (
    ACK_EVENT_PREFIX,
    ANSWER_CODES,
    ANSWER_TIMEOUT,
    DEFAULT_ACK_INTERVAL,
    DEFAULT_MAX_AUDIO_LEAD,
    DEFAULT_MAX_PACED_AUDIO_BYTES,
    MAX_CLIENT_TRUNCATED,
    MAX_ITEMS,
    MAX_OUTSTANDING,
    AckErrorCode,
    AckMode,
    Awaited,
    ItemPlayback,
    PlaybackSettings,
    audio_seconds,
)

__all__ = [
    "ACK_EVENT_PREFIX",
    "ANSWER_TIMEOUT",
    "DEFAULT_ACK_INTERVAL",
    "DEFAULT_MAX_AUDIO_LEAD",
    "DEFAULT_MAX_PACED_AUDIO_BYTES",
    "AckErrorCode",
    "AckMode",
    "ItemPlayback",
    "PlaybackLedger",
    "PlaybackSettings",
    "audio_seconds",
]


class PlaybackLedger:
    """Per-session playback state; see the module docstring.

    Args:
        settings: pacing and ack settings.
        capabilities: what the session's engine does (acks at all, truncation rule).
    """

    def __init__(
        self, settings: PlaybackSettings, capabilities: EngineCapabilities | None = None
    ) -> None:
        self.settings = settings
        self.capabilities = capabilities if capabilities is not None else EngineCapabilities()
        self.items: OrderedDict[str, ItemPlayback] = OrderedDict()
        #: The client sent a playback.ack of its own.
        self.client_acks = False
        #: The sidecar acks for this session now (``auto`` until the client acks;
        #: never in a non-duplex session).
        self.acking = settings.ack is not AckMode.OFF and self.capabilities.duplex_acks
        #: Acks or truncations (ours or the client's) have not been answered yet
        #: (kept current on every change: the engine reader checks it per event).
        self.awaiting_answers = False
        self._client_truncated: OrderedDict[str, None] = OrderedDict()
        self.supports_truncate = False
        self.output_format: str | None = None
        self.output_rate: int | None = None
        #: Acks and truncations in flight, oldest first (see the module docstring).
        self._awaited: deque[Awaited] = deque()
        self._ack_seq = 0
        #: Behaviour the wire showed that the capabilities did not expect (the
        #: shell takes it with take_learned()).
        self._learned: EngineVersion | None = None
        # statistics (plain counters; the shell exports them)
        self.audio_sent = 0.0
        #: Audio seconds released but cut off unplayed by a cancel.
        self.audio_unheard = 0.0
        self.acks_sent = 0
        self.truncations_sidecar = 0
        self.truncations_client = 0
        #: Truncations not sent: the item produced no audio (truncate_needs_audio_item).
        self.truncations_skipped = 0
        self.paced_bound_releases = 0
        self.lead_at_cancel: list[float] = []
        #: Something the core's report takes (lead at cancel, own errors,
        #: learned behaviour) arrived since the last take.
        self.news = False
        #: Errors answering our own frames, hidden from the client, by code.
        self.own_errors: dict[AckErrorCode, int] = {}
        self._own_errors_new: list[AckErrorCode] = []

    # -- what the engine and the client say ---------------------------------------------

    def on_session(self, body: dict[str, Any]) -> None:
        """``session.created``/``session.updated``: output format, truncate support."""
        session = body.get("session")
        if not isinstance(session, dict):
            return
        caps = session.get("capabilities")
        if isinstance(caps, dict):
            self.supports_truncate = caps.get("supports_audio_truncate") is True
        fmt: object = session.get("output_audio_format")
        rate: object = session.get("sample_rate_hz")
        audio = session.get("audio")
        if isinstance(audio, dict) and isinstance(audio.get("output"), dict):
            out = audio["output"]
            spec = out.get("format")
            if isinstance(spec, dict):
                fmt, rate = spec.get("type", fmt), spec.get("rate", rate)
            elif isinstance(spec, str):
                fmt = spec
            rate = out.get("sample_rate_hz", rate)
        if isinstance(fmt, str):
            self.output_format = fmt
        if isinstance(rate, int) and rate > 0:
            self.output_rate = rate

    def on_client_ack(
        self,
        event_id: str | None = None,
        now: float = 0.0,
        body: dict[str, Any] | None = None,
    ) -> bool:
        """The client sent ``playback.ack``. Returns whether to forward it.

        Its ``played_ms`` of a response is what the client heard of it from now on
        (heard estimate, acks and truncation), in every mode.
        """
        if body is not None:
            self._client_heard(body)
        if self.settings.ack is AckMode.ALWAYS:
            return False
        self.client_acks = True
        self.acking = False
        self._await(own=False, item_truncate=False, truncates=False, event_id=event_id, now=now)
        return True

    def _client_heard(self, body: dict[str, Any]) -> None:
        rid, played = body.get("response_id"), body.get("played_ms")
        if not isinstance(rid, str) or isinstance(played, bool) or not isinstance(played, int):
            return
        item = self.items.get(rid)
        if item is not None and played > item.heard_ms:
            item.heard_ms = played

    def on_client_truncate(
        self, item_id: str | None, event_id: str | None = None, now: float = 0.0
    ) -> None:
        """The client sent ``conversation.item.truncate`` itself (it is forwarded)."""
        self.truncations_client += 1
        self._await(
            own=False,
            item_truncate=True,
            truncates=True,
            event_id=event_id,
            item_id=item_id,
            now=now,
        )
        if item_id is None:
            return
        self._client_truncated[item_id] = None
        if len(self._client_truncated) > MAX_CLIENT_TRUNCATED:
            self._client_truncated.popitem(last=False)

    def swallow(self, event: UpstreamEvent, now: float = 0.0) -> bool:
        """Settle an engine answer to an ack or truncation in flight.

        Returns:
            True when it answers one of the sidecar's own: the client never
            asked for it, so it is not shown to the client. An answer to the
            client's own frame, or to nothing in flight, returns False.
        """
        if not self.awaiting_answers:
            return False
        self._expire(now)
        kind = event.type
        body = event.body
        if kind == "playback.acknowledged":
            entry = self._settle(None)
            return entry is not None and entry.own
        if kind == "conversation.item.truncated" and body is not None:
            item_id = body.get("item_id")
            for awaited in self._awaited:
                if awaited.item_truncate and not awaited.truncated and awaited.item_id == item_id:
                    awaited.truncated = True  # its playback.acknowledged follows
                    return awaited.own
            return False
        if kind != "error" or body is None:
            return False
        error = body.get("error")
        if not isinstance(error, dict):
            return False
        code = error.get("code")
        echoed = error.get("event_id")
        if isinstance(echoed, str) and echoed:
            entry = self._settle(echoed)
        elif isinstance(code, str) and code in ANSWER_CODES:
            entry = self._settle(None)  # no event_id: it answers the oldest in flight
        else:
            return False
        if entry is None or not entry.own:
            return False
        known = ANSWER_CODES.get(code) if isinstance(code, str) else None
        self._own_error(entry, known or AckErrorCode.OTHER)
        return True

    def _await(
        self,
        *,
        own: bool,
        item_truncate: bool,
        truncates: bool,
        event_id: str | None,
        now: float,
        item_id: str | None = None,
    ) -> None:
        awaited = self._awaited
        awaited.append(
            Awaited(
                own=own,
                item_truncate=item_truncate,
                truncates=truncates,
                event_id=event_id,
                item_id=item_id,
                sent_at=now,
            )
        )
        if len(awaited) > MAX_OUTSTANDING:
            awaited.popleft()
        self.awaiting_answers = True

    def _expire(self, now: float) -> None:
        """Forget frames unanswered for ``ANSWER_TIMEOUT`` (oldest first)."""
        awaited = self._awaited
        while awaited and now - awaited[0].sent_at > ANSWER_TIMEOUT:
            awaited.popleft()
        self.awaiting_answers = bool(awaited)

    def _settle(self, event_id: str | None) -> Awaited | None:
        """Remove and return the frame an answer settles: the one ``event_id``
        names, else the oldest in flight (None: none)."""
        awaited = self._awaited
        entry: Awaited | None = None
        if event_id is None:
            entry = awaited.popleft() if awaited else None
        else:
            for candidate in awaited:
                if candidate.event_id == event_id:
                    entry = candidate
                    awaited.remove(candidate)
                    break
        self.awaiting_answers = bool(awaited)
        return entry

    def _own_error(self, entry: Awaited, code: AckErrorCode) -> None:
        """One of our frames failed: count it; learn what the failure says."""
        self.own_errors[code] = self.own_errors.get(code, 0) + 1
        self._own_errors_new.append(code)
        self.news = True
        if code is AckErrorCode.INVALID_EVENT:
            # A non-duplex session: it refuses every ack; send it no more.
            self.capabilities = self.capabilities.for_session(duplex=False)
            self.acking = False
        elif code is AckErrorCode.BAD_EVENT and entry.truncates:
            self.learn(WireSign.TRUNCATION_REFUSED)

    def learn(self, sign: WireSign) -> None:
        """The wire showed ``sign``, a behaviour of some releases (the session adapts at once)."""
        version = shown_by(sign)
        learned = self.capabilities.learn(version)
        if learned is not self.capabilities:
            self.capabilities = learned
            self._learned = version
            self.news = True

    def take_learned(self) -> EngineVersion | None:
        """Behaviour newly seen on the wire since the last call (for the shell)."""
        learned, self._learned = self._learned, None
        return learned

    def take_own_errors(self) -> list[AckErrorCode]:
        """Codes of our frames' errors since the last call (for the metric)."""
        if not self._own_errors_new:
            return []
        out, self._own_errors_new = self._own_errors_new, []
        return out

    # -- audio released to the client ---------------------------------------------------

    def seconds_of(self, event: UpstreamEvent, *, chars: int | None = None) -> float:
        """Audio seconds of a delta (or of ``chars`` base64 characters of its format)."""
        meta = event.audio_meta or {}
        fmt = meta.get("format")
        rate = meta.get("sample_rate_hz")
        fmt = fmt if isinstance(fmt, str) else self.output_format
        rate = rate if isinstance(rate, int) else self.output_rate
        if chars is not None:
            return audio_seconds(4, fmt, rate) * chars / 4
        return audio_seconds(event.audio_chars, fmt, rate)

    def _item(self, event: UpstreamEvent) -> ItemPlayback:
        rid = event.response_id or ""
        item = self.items.get(rid)
        if item is None:
            meta = event.audio_meta or {}
            item_id = meta.get("item_id")
            item = ItemPlayback(rid, item_id if isinstance(item_id, str) else None)
            if self.settings.client_reports:
                item.heard_ms = 0
            self.items[rid] = item
            if len(self.items) > MAX_ITEMS:
                for key, old in self.items.items():
                    if old.finished or old.done:
                        del self.items[key]
                        break
                else:
                    self.items.popitem(last=False)
        return item

    def release_at(self, event: UpstreamEvent, now: float, pending_bytes: int) -> float | None:
        """When a paced audio delta may go to the client (None: now).

        Released once what was already released of its response is at most
        the time since its first delta plus ``max_audio_lead``. Above
        ``max_paced_audio_bytes`` of pending output it goes at once.
        """
        if not self.settings.pacing or event.response_id is None:
            return None
        item = self.items.get(event.response_id)
        if item is None or item.started_at is None:
            return None
        when = item.started_at + item.sent - self.settings.max_audio_lead
        if when <= now:
            return None
        if pending_bytes >= self.settings.max_paced_audio_bytes:
            self.paced_bound_releases += 1
            return None
        return when

    def released(self, event: UpstreamEvent, now: float) -> None:
        """An audio delta was taken for writing to the client (per-event path)."""
        rid = event.response_id
        if rid is None:
            return
        item = self.items.get(rid)
        if item is None:
            item = self._item(event)
        if item.started_at is None:
            item.started_at = now
            # One format per response: seconds per base64 character, resolved once.
            item.seconds_per_char = self.seconds_of(event, chars=1)
        seconds = event.audio_chars * item.seconds_per_char
        item.sent += seconds
        self.audio_sent += seconds

    def heard(self, now: float) -> float:
        """Audio seconds the client has played by ``now`` (the usage record's estimate).

        What was released, less what cancels cut off unplayed, less what is
        still ahead of the playhead of the items not finished.
        """
        ahead = sum(item.lead(now) for item in self.items.values() if not item.finished)
        return max(0.0, self.audio_sent - self.audio_unheard - ahead)

    def done_delivered(self, response_id: str) -> None:
        item = self.items.get(response_id)
        if item is not None:
            item.done = True

    # -- what goes to the engine -------------------------------------------------------------

    def acks_due(self, now: float) -> list[str]:
        """``playback.ack`` frames to write now (empty when not acking)."""
        if not self.acking:
            return []
        out = []
        interval = self.settings.ack_interval
        for item in self.items.values():
            if item.finished or item.started_at is None:
                continue
            played = item.played(now)
            played_ms = round(played * 1000)
            final = item.done and played >= item.sent
            # Nothing heard yet is nothing to say (the first ack comes once audio plays).
            progressed = played_ms > max(item.acked_ms, 0)
            # The first one an interval after the audio started, as next_ack_at says.
            last = max(item.last_ack_at, item.started_at)
            if final or (now - last >= interval and progressed):
                out.append(self._ack(item, played_ms, now, truncate=False))
                if final:
                    item.finished = True
        return out

    def next_ack_at(self, now: float) -> float | None:
        """When ``acks_due`` may next have something to say (None: nothing playing).

        May be ``now`` or earlier when an ack is due; called right after
        ``acks_due`` it is always later than ``now``.
        """
        if not self.acking:
            return None
        interval = self.settings.ack_interval
        soonest: float | None = None
        for item in self.items.values():
            if item.finished or item.started_at is None:
                continue
            at = max(item.last_ack_at, item.started_at) + interval
            if item.done:
                at = min(at, item.started_at + item.sent)
            soonest = at if soonest is None else min(soonest, at)
        return soonest

    def on_cancel(self, response_id: str, now: float) -> list[str]:
        """A cancel trigger hit ``response_id``: tell the engine what was heard."""
        item = self.items.get(response_id)
        if item is None or item.started_at is None or item.finished:
            return []
        self.lead_at_cancel.append(item.lead(now))
        self.news = True
        played = item.played(now)
        relayed = item.sent
        # What is in the client but unheard will not be played (the client
        # clears it, or the pacing kept it short): the item ends here.
        item.sent = played
        item.finished = True
        self.audio_unheard += relayed - played
        if item.item_id is not None and item.item_id in self._client_truncated:
            return []
        if self.capabilities.truncate_needs_audio_item and not relayed > 0:
            # The engine refuses (bad_event) to truncate an item that produced no audio.
            self.truncations_skipped += 1
            return []
        played_ms = round(played * 1000)
        if self.supports_truncate and item.item_id is not None:
            self.truncations_sidecar += 1
            # vLLM-Omni answers with conversation.item.truncated and then a
            # playback.acknowledged {truncate: true}: both are ours to hide.
            event_id = self._next_event_id()
            self._await(
                own=True,
                item_truncate=True,
                truncates=True,
                event_id=event_id,
                item_id=item.item_id,
                now=now,
            )
            return [
                orjson.dumps(
                    {
                        "type": "conversation.item.truncate",
                        "event_id": event_id,
                        "item_id": item.item_id,
                        "content_index": 0,
                        "audio_end_ms": played_ms,
                    }
                ).decode()
            ]
        if not self.acking:
            return []
        self.truncations_sidecar += 1
        return [self._ack(item, played_ms, now, truncate=True)]

    def _next_event_id(self) -> str:
        self._ack_seq += 1
        return f"{ACK_EVENT_PREFIX}{self._ack_seq}"

    def _ack(self, item: ItemPlayback, played_ms: int, now: float, *, truncate: bool) -> str:
        item.acked_ms = played_ms
        item.last_ack_at = now
        self.acks_sent += 1
        event_id = self._next_event_id()
        self._await(own=True, item_truncate=False, truncates=truncate, event_id=event_id, now=now)
        body: dict[str, Any] = {
            "type": "playback.ack",
            "event_id": event_id,
            "response_id": item.response_id,
            "played_ms": played_ms,
            "committed_ms": played_ms,
        }
        if item.item_id is not None:
            body["item_id"] = item.item_id
        if truncate:
            body["truncate"] = True
        return orjson.dumps(body).decode()

    def view(self, now: float) -> dict[str, Any]:
        """The ledger as JSON for ``/debug/sessions`` (bounded by ``MAX_ITEMS``)."""
        return {
            "pacing": self.settings.pacing,
            "acking": self.acking,
            "client_acks": self.client_acks,
            "acks_sent": self.acks_sent,
            "truncations": {
                "client": self.truncations_client,
                "sidecar": self.truncations_sidecar,
                "skipped_no_audio": self.truncations_skipped,
            },
            "awaiting_answers": len(self._awaited),
            "own_errors": {code.value: n for code, n in self.own_errors.items()},
            "capabilities": self.capabilities.view(),
            "items": [
                {
                    "response_id": item.response_id,
                    "item_id": item.item_id,
                    "delivered_ms": round(item.sent * 1000),
                    "played_ms": round(item.played(now) * 1000),
                    "lead_ms": round(item.lead(now) * 1000),
                    "acked_ms": max(item.acked_ms, 0),
                    "done": item.done,
                    "finished": item.finished,
                }
                for item in self.items.values()
            ],
        }

    def take_lead_observations(self) -> list[float]:
        self.news = False
        out, self.lead_at_cancel = self.lead_at_cancel, []
        return out
