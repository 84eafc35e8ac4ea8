"""The operator console: JSON views for ``/debug/*`` and the page's static files.

Plain dicts built from what the sidecar already keeps, which the handlers of
``proxy/admin/admin_app.py`` only serialise; every answer is bounded
(``MAX_PAGE_SESSIONS``, ``LIFECYCLE_EVENTS``). docs/design.md, Routes and
listeners; the versioned JSON itself is documented in docs/console.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from metrics import DIRECTIONS, DROP_REASONS, OVERFLOW_POLICIES, REJECT_REASONS
from proxy.native import CORE_BUILD

if TYPE_CHECKING:
    from prometheus_client import Counter

    from proxy.edge.state import ProxyState

__all__ = [
    "API_VERSION",
    "CONTENT_SECURITY_POLICY",
    "LIST_IDS",
    "MAX_PAGE_SESSIONS",
    "STALE_AUDIO_REASONS",
    "VIEW_CHUNK",
    "Asset",
    "engine_entries",
    "load_assets",
    "session_detail",
    "sessions_page",
    "summary",
]

#: Bumped when a field changes meaning or goes away (adding fields is compatible).
API_VERSION: Final = 1
#: Most sessions one ``/debug/sessions`` answer carries (sessions); more → page.
MAX_PAGE_SESSIONS: Final = 500
#: Sessions rendered between two yields to the event loop while building a page,
#: so a 500-session answer never holds the relay up for more than one chunk.
VIEW_CHUNK: Final = 25
#: Response ids per session in ``/debug/sessions`` (``cancelled_responses``:
#: the newest ones; ``tombstones`` has the count; the detail view has them all).
LIST_IDS: Final = 8
#: Drop reasons that mean "audio of a cancelled response that the client never heard".
STALE_AUDIO_REASONS: Final = ("cancelled_audio", "late_audio")

#: Only our own files: no inline script or style, no other origin, no framing.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_CONTENT_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


@dataclass(frozen=True, slots=True)
class Asset:
    """One static file of the page, read once at start-up."""

    body: bytes
    content_type: str


def load_assets() -> dict[str, Asset]:
    """``{file name: Asset}`` for every file in ``proxy/admin/console/static``."""
    out: dict[str, Asset] = {}
    for item in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + item.name.rpartition(".")[2]
        if item.is_file() and suffix in _CONTENT_TYPES:
            out[item.name] = Asset(item.read_bytes(), _CONTENT_TYPES[suffix])
    return out


def engine_entries(state: ProxyState) -> list[dict[str, Any]]:
    """The engines as the console shows them, one entry per replica.

    A pure reader of the engines' admission state (engine_launcher/admission.py),
    which the supervisors' state changes feed: what a person asks first
    during an incident, since when each engine has been up, how often it
    restarted and why it last failed, whether it is draining or said it is full.
    """
    engines = state.router
    if engines is None:
        return []
    now = time.monotonic()
    return [
        {
            "kind": state.settings.engine.kind,
            "state": engines.states[index],
            "uptime_seconds": engines.uptime(index),
            "restarts": engines.restarts(index),
            "last_failure": engines.last_failure[index] or None,
            "last_failure_at": engines.last_failure_at[index],
            "target": engines.live_target(index),
            "engine": index,
            "draining": engines.draining[index],
            # Seconds it still admits nothing after saying it is full (0: admits).
            "engine_full_for_seconds": engines.full_for(index, now),
        }
        for index in range(engines.count)
    ]


def _by_label(counter: Counter, label: str, values: Iterable[str]) -> dict[str, float]:
    """A counter's current values by one label, summed over the others."""
    out = dict.fromkeys(values, 0.0)
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get(label) in out:
                out[sample.labels[label]] += sample.value
    return out


def _value(counter: Counter) -> float:
    return sum(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def _budget(state: ProxyState) -> dict[str, int]:
    return {
        "pending_bytes": state.settings.max_pending_output_bytes,
        "pending_events": state.settings.max_pending_output_events,
    }


def summary(state: ProxyState, *, started: float) -> dict[str, Any]:
    """``/debug/summary``: engines, totals and limits; counters are cumulative.

    Rates (events/s, drops/s) are left to the reader: two answers and their
    ``monotonic`` difference give them without the sidecar keeping history.
    """
    registry = state.registry
    m = state.metrics
    dropped = _by_label(m.dropped_events, "reason", DROP_REASONS)
    events = _by_label(m.events, "direction", DIRECTIONS)
    sizes = _by_label(m.bytes, "direction", DIRECTIONS)
    c2u_events, c2u_bytes, u2c_events, u2c_bytes = registry.unflushed()
    events[DIRECTIONS[0]] += c2u_events
    events[DIRECTIONS[1]] += u2c_events
    sizes[DIRECTIONS[0]] += c2u_bytes
    sizes[DIRECTIONS[1]] += u2c_bytes
    refusal = state.refusal()
    return {
        "version": API_VERSION,
        "time": time.time(),
        "monotonic": time.monotonic(),
        "uptime_seconds": round(time.monotonic() - started, 3),
        # docs/design.md, Performance: the compiled build ("mypyc") or pure Python.
        "build": CORE_BUILD,
        # docs/design.md, Socket activation: {"listen"|"admin": {"url", "source"}}.
        "listeners": state.listeners,
        "ready": refusal is None,
        "not_ready_reason": None if refusal is None else refusal[1],
        "engines": engine_entries(state),
        # docs/design.md, Engine capabilities: what the sidecar expects of the engine.
        "engine_capabilities": registry.capabilities.current.view(),
        "sessions": {
            "live": len(registry.relays),
            "limit": state.admission.max_sessions,
            "started": _value(m.sessions_started),
            "rejected": _by_label(m.sessions_rejected, "reason", REJECT_REASONS),
        },
        "pending": {
            "bytes": registry.total_pending_bytes,
            "events": registry.total_pending_events,
            "cap_bytes": state.settings.max_total_pending_output_bytes,
        },
        "budget": _budget(state),
        "totals": {
            "events": events,
            "bytes": sizes,
            "dropped_events": dropped,
            "overflows": _by_label(m.overflows, "policy", OVERFLOW_POLICIES),
            "cancels": registry.total_cancels,
            "stale_audio_dropped": sum(dropped[r] for r in STALE_AUDIO_REASONS),
        },
        # docs/design.md, Usage: ended sessions' usage per API key name (never a key).
        "usage": state.usage.view(),
        # docs/design.md, Quotas: each named key's limits and this process's counts.
        "quota": {**state.quota.readiness(), "keys": state.quota.headroom()},
    }


async def sessions_page(
    state: ProxyState, *, offset: int, limit: int, query: str
) -> dict[str, Any]:
    """``/debug/sessions``: one page of live sessions, oldest first.

    Rendered ``VIEW_CHUNK`` sessions at a time with a yield to the event loop
    in between: the relay shares this loop, and one 500-session page built in
    one go would delay its events by the whole build (seen as added p99 in
    the realtime-latency bench). A session that ends meanwhile is left out.
    """
    registry = state.registry
    total, keys = registry.select(offset, limit, query)
    sessions: list[dict[str, Any]] = []
    for start in range(0, len(keys), VIEW_CHUNK):
        if start:
            await asyncio.sleep(0)
        for key in keys[start : start + VIEW_CHUNK]:
            view = registry.view(key, max_ids=LIST_IDS)
            if view is not None:
                sessions.append(view)
    return {
        "version": API_VERSION,
        "live": len(registry.relays),
        "total": total,
        "offset": offset,
        "limit": limit,
        "budget": _budget(state),
        "sessions": sessions,
        "total_pending_bytes": registry.total_pending_bytes,
        "total_pending_events": registry.total_pending_events,
    }


def session_detail(state: ProxyState, key: str) -> dict[str, Any] | None:
    """``/debug/sessions/{id}``: a live session, else a recently ended one, else None."""
    registry = state.registry
    view = registry.detail(key)
    if view is not None:
        return {"version": API_VERSION, "live": True, "budget": _budget(state), "session": view}
    for ended in reversed(registry.recent):
        if ended.get("id") == key:
            return {
                "version": API_VERSION,
                "live": False,
                "budget": _budget(state),
                "session": ended,
            }
    return None
