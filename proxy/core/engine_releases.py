"""The vLLM-Omni releases the sidecar tells apart: one row of named capabilities each.

The one place a release is written (docs/design.md, New engine release): the
capabilities, the OpenAI dialect's tables, ``engine.version``'s choices and the
metric label values derive from it. Pure data importing only the standard
library, so the launcher and the metrics may import it too (docs/design.md,
Dependency direction); only the simulator, another process, keeps its own rows.
Use sites read a capability by name, never compare versions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Final

__all__ = [
    "CAPABILITIES",
    "RELEASES",
    "EngineRelease",
    "EngineVersion",
    "WireSign",
    "release_of",
    "shown_by",
]


class EngineVersion(enum.Enum):
    """Engine behaviours the sidecar tells apart (the ``version`` label), oldest first.

    A member per row of :data:`RELEASES`, plus ``UNKNOWN`` (behaves as the oldest).
    """

    UNKNOWN = "unknown"
    V0_30 = "0.30"
    V0_31 = "0.31"
    V0_32 = "0.32"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRelease:
    """What one vLLM-Omni release does that the sidecar or the simulator depends on.

    Each field is a named capability (True: the release does it), read from
    the release's wheel (docs/engine-protocol.md, Version differences). A
    capability a release lost would be a new field saying so: the wire only
    moves the version up (:func:`shown_by`).

    Attributes:
        version: the release (its major.minor).
        bounded_output: the engine bounds each session's output itself
            (2 MiB / 512 events, then ``output_backpressure`` and a close).
        drops_cancelled_audio: queued audio of a cancelled response is removed
            before it is sent.
        truncate_needs_audio_item: a truncation (``playback.ack`` with
            ``truncate: true``, ``conversation.item.truncate``) naming no item
            that produced audio fails with ``bad_event``.
        ack_errors_carry_event_id: an ack's errors (``playback_ack_too_late``,
            ``playback_item_not_found``, ``playback_item_mismatch``,
            ``bad_event``) echo the ack's ``event_id``.
        audio_only_acks_never_late: ``playback_ack_too_late`` is not raised
            for a response without text.
        open_rejections_retryable: a refused open (a full engine's
            ``resource_exhausted``) carries ``error.retryable: true``.
        openai_realtime_handler: a model served without ``session_mode:
            duplex`` gets the plain OpenAI-style ``/v1/realtime`` handler
            (which answers ``playback.ack`` ``invalid_event``).
        semantic_vad: ``turn_detection`` {type: ``semantic_vad``} is known; a
            deployment without its model answers ``error``
            {``semantic_vad_unavailable``}.
    """

    version: EngineVersion
    bounded_output: bool
    drops_cancelled_audio: bool
    truncate_needs_audio_item: bool
    ack_errors_carry_event_id: bool
    audio_only_acks_never_late: bool
    open_rejections_retryable: bool
    openai_realtime_handler: bool
    semantic_vad: bool


#: Every release, oldest first. A new release: one row here, then the
#: checklist in docs/design.md (New engine release).
RELEASES: Final[tuple[EngineRelease, ...]] = (
    EngineRelease(
        version=EngineVersion.V0_30,
        bounded_output=False,
        drops_cancelled_audio=False,
        truncate_needs_audio_item=False,
        ack_errors_carry_event_id=True,
        audio_only_acks_never_late=False,
        open_rejections_retryable=False,
        openai_realtime_handler=False,
        semantic_vad=False,
    ),
    EngineRelease(
        version=EngineVersion.V0_31,
        bounded_output=True,
        drops_cancelled_audio=True,
        truncate_needs_audio_item=False,
        ack_errors_carry_event_id=True,
        audio_only_acks_never_late=False,
        open_rejections_retryable=False,
        openai_realtime_handler=True,
        semantic_vad=False,
    ),
    EngineRelease(
        version=EngineVersion.V0_32,
        bounded_output=True,
        drops_cancelled_audio=True,
        truncate_needs_audio_item=True,
        ack_errors_carry_event_id=False,
        audio_only_acks_never_late=True,
        open_rejections_retryable=True,
        openai_realtime_handler=True,
        semantic_vad=True,
    ),
)

#: The names of the capabilities (every field but ``version``), in declaration order.
CAPABILITIES: Final[tuple[str, ...]] = tuple(
    f.name for f in fields(EngineRelease) if f.name != "version"
)

_BY_VERSION: Final[dict[EngineVersion, EngineRelease]] = {r.version: r for r in RELEASES}


def release_of(version: EngineVersion) -> EngineRelease:
    """The row of ``version`` (``UNKNOWN``: the oldest release's)."""
    return _BY_VERSION.get(version, RELEASES[0])


class WireSign(enum.Enum):
    """Behaviour seen on the wire that only some releases show.

    The value names the capability it proves; the release it teaches is the
    oldest with that capability (:func:`shown_by`).
    """

    #: The engine's ``error`` {output_backpressure}: it bounds output itself.
    OUTPUT_BACKPRESSURE = "bounded_output"
    #: ``bad_event`` answering one of the sidecar's own truncations.
    TRUNCATION_REFUSED = "truncate_needs_audio_item"


def _oldest_with(capability: str) -> EngineVersion:
    for release in RELEASES:
        if getattr(release, capability) is True:
            return release.version
    raise ValueError(f"no release has {capability!r}")


_SHOWN_BY: Final[dict[WireSign, EngineVersion]] = {
    sign: _oldest_with(sign.value) for sign in WireSign
}


def shown_by(sign: WireSign) -> EngineVersion:
    """The oldest release whose behaviour ``sign`` is (what the wire teaches)."""
    return _SHOWN_BY[sign]
