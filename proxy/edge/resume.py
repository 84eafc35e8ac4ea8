"""A client's ``session.resume`` on a new connection (docs/design.md, Resume).

The first message of a connection that does not open its engine session at
connect may be ``session.resume``. A session this sidecar holds is resumed
here: the token and the API key are checked, and the relay replays what the
client missed on the new connection. One it does not hold goes to the engine
(proxy/edge/session_open.py) when its token is bound to this key
(proxy/core/resume_token.py). A forged or replayed token, another key, a
malformed resume and a session nobody holds all get the same answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from metrics import SidecarMetrics
from proxy.core import notices
from proxy.core.events import ClientKind, EventKind, classify_client, classify_upstream, error_code
from proxy.core.lifecycle import SessionState
from proxy.core.resume_token import ResumeForEngine, ResumeTokens
from proxy.edge.resume_spent import SpentTokens
from proxy.edge.session_slots import first_data
from proxy.session.client_side import ClientSide
from proxy.session.registry import LiveSession, SessionRegistry
from proxy.session.upstream_link import UpstreamLink

__all__ = [
    "ResumeRequest",
    "current",
    "first_message",
    "parse_resume",
    "refuse_resume",
    "resume_held",
    "resume_unknown",
    "verified",
]

log = logging.getLogger("omni_sidecar.edge.app")
#: The access log: one line per session, and one per attachment after the first.
access_log = logging.getLogger("omni_sidecar.access")

#: What a refused resume gets, whatever the reason (the core's one answer).
_REFUSED: Final = notices.resume_refused().text


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    """A first message whose ``type``, as a JSON parser reads it, is ``session.resume``."""

    session_id: str
    token: str
    cursor: int
    #: The frame as parsed (the one reading every decision about it is made from).
    body: dict[str, Any]
    #: Its fields are what a resume needs; one that is not is refused, never passed on.
    well_formed: bool

    def for_engine(self, tokens: ResumeTokens, key_id: str) -> ResumeForEngine | None:
        """The frame for the engine (the engine's own token in place of the client's),
        when the client's token is bound to this session and ``key_id``; else None."""
        return tokens.engine_resume(self.body, key_id) if self.well_formed else None


#: The engine's first answers to a resume that say it holds the session (docs/engine-protocol.md,
#: Resume): resumed, a resync, or a concurrent resume won the race. Any other says it does not.
_FOUND: Final = frozenset({"session.resumed", "session.resync_required"})


def resume_unknown(answer: str | None) -> bool:
    """The engine's first answer to a resume says it does not hold the session."""
    if answer is None:
        return False
    event = classify_upstream(answer)
    if event.kind is EventKind.ERROR:
        return error_code(event) != "session_resume_conflict"
    return event.type not in _FOUND


async def first_message(
    client: Any, timeout: float, engine: UpstreamLink | None = None
) -> aiohttp.WSMessage | None:
    """The connection's first data message (None: none within ``timeout``, or ``engine``
    spoke first: it opened a session at connect or ends, so it reads no resume)."""
    reading = asyncio.ensure_future(first_data(client))
    spoke = asyncio.ensure_future(engine.first_text(timeout) if engine else asyncio.sleep(timeout))
    try:
        done, _ = await asyncio.wait(
            {reading, spoke}, timeout=timeout, return_when="FIRST_COMPLETED"
        )
    finally:
        for task in (reading, spoke):
            task.cancel()
        await asyncio.gather(reading, spoke, return_exceptions=True)
    msg: aiohttp.WSMessage | None = reading.result() if reading in done else None
    return msg


def parse_resume(msg: aiohttp.WSMessage | None) -> ResumeRequest | None:
    """The first message as a resume, read as the engine's JSON parser reads it (so an
    escape in ``type`` cannot make the sidecar and the engine disagree); None when it
    is not one (the message goes on as it is)."""
    if msg is None or msg.type is not aiohttp.WSMsgType.TEXT:
        return None
    event = classify_client(msg.data)
    if event.kind is not ClientKind.SESSION_RESUME or event.body is None:
        return None
    body = event.body
    session_id, token = body.get("session_id"), body.get("resume_token")
    cursor = body.get("last_received_server_event_seq", 0)
    if not (isinstance(session_id, str) and isinstance(token, str)) or type(cursor) is not int:
        return ResumeRequest("", "", 0, body, well_formed=False)
    return ResumeRequest(session_id, token, max(0, cursor), body, well_formed=True)


def current(registry: SessionRegistry, request: ResumeRequest, key_id: str) -> bool:
    """The resume names a session held here, with this key and its current token."""
    return registry.resumable(request.session_id, request.token, key_id) is not None


async def verified(
    request: ResumeRequest, key_id: str, tokens: tuple[ResumeTokens, SpentTokens]
) -> str | None:
    """The resume's frame for the engine, when its token is this key's for this session
    and not spent (an older generation than one issued: proxy/edge/resume_spent.py)."""
    for_engine = request.for_engine(tokens[0], key_id)
    if for_engine is None:
        return None
    parts = for_engine.parts
    if await tokens[1].spent(request.session_id, parts.engine_token, parts.generation):
        return None
    return for_engine.text


async def refuse_resume(metrics: SidecarMetrics, client: Any, request: ResumeRequest) -> None:
    """The one answer to a resume that is not this key's (forged, spent, another key,
    malformed, unknown), whatever the reason; counted as refused."""
    metrics.resumes.labels("refused").inc()
    log.info("session.resume of %s refused", request.session_id or "?")
    await _refuse(client, _REFUSED)


async def resume_held(
    registry: SessionRegistry,
    metrics: SidecarMetrics,
    client: Any,
    side_for: Callable[[UpstreamLink], ClientSide],
    request: ResumeRequest,
    key_id: str,
    tokens: tuple[ResumeTokens, SpentTokens],
) -> bool:
    """Resume a session this sidecar holds on ``client`` (``side_for`` makes the
    session's client side of it); False when it holds none by that id.

    Returns once the session is done with the connection (or refused it).
    """
    if not request.well_formed:
        await refuse_resume(metrics, client, request)
        return True
    if not registry.holds(request.session_id):
        return False
    relay = registry.resumable(request.session_id, request.token, key_id)
    if relay is None:
        await refuse_resume(metrics, client, request)
        return True
    side = side_for(relay.upstream)
    previous = relay.side
    side.follow(previous)
    if registry.handing_over or not relay.attach(side, request.cursor):
        await _not_resumed(registry, metrics, relay, side.client, request)
        return True
    metrics.resumes.labels("resumed").inc()
    verified = tokens[0].engine_resume(request.body, key_id)
    if verified is not None:  # attached: the token it presented, and every older one, is spent
        parts = verified.parts
        await tokens[1].issued(request.session_id, parts.engine_token, parts.generation + 1)
    relay.log.info("session resumed from %s (cursor %d)", side.address or "?", request.cursor)
    _log_attachment(relay.key, request, previous, side)
    await side.done.wait()
    return True


async def _not_resumed(
    registry: SessionRegistry,
    metrics: SidecarMetrics,
    relay: LiveSession,
    client: Any,
    request: ResumeRequest,
) -> None:
    """``Relay.attach`` said no (or was not asked): why decides what the client gets."""
    if registry.handing_over:
        # The drain hands the session over: the client resumes on another sidecar with
        # the token it holds, which nothing here spent (close 1012, as a hand-over).
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await client.close(code=1012, message=b"handed_over")
    elif relay.view.state is SessionState.CLOSED:
        await refuse_resume(metrics, client, request)  # it ended meanwhile: held nowhere now
    else:
        metrics.resumes.labels("resync_required").inc()  # attach wrote session.resync_required
        await _refuse(client, None)


def _log_attachment(
    key: str, request: ResumeRequest, previous: ClientSide, side: ClientSide
) -> None:
    """One access line per attachment after the first: the connection that ended
    (who, how long, what it was written) and the one that took over."""
    fields = {
        "session": key,
        "engine_session": request.session_id,
        "client": side.address or "-",
        "attachment": side.attachment,
        "cursor": request.cursor,
        "previous_client": previous.address or "-",
        "previous_duration_s": round(side.attached_at - previous.attached_at, 3),
        "previous_events_out": previous.writer.frames_written,
        "previous_bytes_out": previous.writer.bytes_written,
    }
    access_log.info("session resumed", extra=fields)


async def _refuse(client: Any, text: str | None) -> None:
    """Send ``text`` (unless sent already) and close the connection, within 5 s."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5.0):
            if text is not None:
                await client.send_str(text)
            await client.close(code=1000, message=b"resume_refused")
