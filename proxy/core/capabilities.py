"""What the engine does, as a small value the sessions read.

vLLM-Omni changed behaviour a proxy depends on between releases and has no
version endpoint: the version comes from ``config``, then ``preflight``, then
what a session saw on the ``wire`` (never overriding the first two, only
moving up), else ``unknown`` (behave as 0.30); docs/design.md, Engine
capabilities. Sans-I/O; label values are this module's enum values.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

__all__ = [
    "CapabilitySource",
    "EngineCapabilities",
    "EngineVersion",
    "opens_at_connect",
    "opens_with_first_message",
    "parse_version",
    "session_is_duplex",
]


class EngineVersion(enum.Enum):
    """Engine behaviours the sidecar tells apart (the ``version`` label)."""

    UNKNOWN = "unknown"
    V0_30 = "0.30"
    V0_31 = "0.31"
    V0_32 = "0.32"


class CapabilitySource(enum.Enum):
    """Where the version came from (the ``source`` label), weakest first."""

    UNKNOWN = "unknown"
    WIRE = "wire"
    PREFLIGHT = "preflight"
    CONFIG = "config"


_ORDER: Final = (EngineVersion.V0_30, EngineVersion.V0_31, EngineVersion.V0_32)
_RANK: Final = {source: rank for rank, source in enumerate(CapabilitySource)}
_MAJOR_MINOR: Final = re.compile(r"^\s*v?(\d+)\.(\d+)")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def parse_version(text: str | None) -> EngineVersion:
    """The behaviour of a ``vllm-omni`` release version (``"0.32.0rc1"`` → 0.32).

    A release newer than the newest known behaves as the newest known, one
    older than 0.30 as 0.30; text that is not a version is ``UNKNOWN``.
    """
    match = _MAJOR_MINOR.match(text or "")
    if match is None:
        return EngineVersion.UNKNOWN
    major, minor = int(match.group(1)), int(match.group(2))
    if major > 0 or minor > 32:
        return EngineVersion.V0_32
    if minor < 30:
        return EngineVersion.V0_30
    return EngineVersion(f"0.{minor}")


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What the engine does, derived from its version (see :meth:`of`).

    Attributes:
        version: the behaviour assumed.
        source: where ``version`` came from.
        bounded_output: the engine bounds each session's output itself (0.31+:
            2 MiB / 512 events, then ``output_backpressure`` and a close); a
            sidecar that stops reading to push back gets the session closed.
        drops_cancelled_audio: the engine removes queued audio of a cancelled
            response before sending it (0.31+); the sidecar filters anyway.
        truncate_needs_audio_item: a truncation (``playback.ack`` with
            ``truncate: true``, ``conversation.item.truncate``) must name an
            item that produced audio, else ``bad_event`` (0.32); the sidecar
            then truncates only items whose audio it relayed.
        duplex_acks: the session's engine takes ``playback.ack`` (a duplex
            session). A non-duplex session answers it ``invalid_event``; the
            sidecar sends it no acks.
    """

    version: EngineVersion = EngineVersion.UNKNOWN
    source: CapabilitySource = CapabilitySource.UNKNOWN
    bounded_output: bool = False
    drops_cancelled_audio: bool = False
    truncate_needs_audio_item: bool = False
    duplex_acks: bool = True

    @classmethod
    def of(cls, version: EngineVersion, source: CapabilitySource) -> EngineCapabilities:
        """The capabilities of ``version`` (``UNKNOWN``: those of 0.30)."""
        if version is EngineVersion.UNKNOWN:
            source = CapabilitySource.UNKNOWN
        at_least = _ORDER.index(version) if version in _ORDER else 0
        return cls(
            version=version,
            source=source,
            bounded_output=at_least >= 1,
            drops_cancelled_audio=at_least >= 1,
            truncate_needs_audio_item=at_least >= 2,
        )

    @classmethod
    def resolve(cls, setting: str, preflight: str | None) -> EngineCapabilities:
        """From ``engine.version`` (``auto`` or a version) and preflight's package version."""
        if setting != "auto":
            return cls.of(EngineVersion(setting), CapabilitySource.CONFIG)
        found = parse_version(preflight)
        if found is not EngineVersion.UNKNOWN:
            return cls.of(found, CapabilitySource.PREFLIGHT)
        return cls()

    def learn(self, version: EngineVersion) -> EngineCapabilities:
        """These capabilities after the wire showed ``version``'s behaviour.

        Returns:
            ``self`` when config or preflight decided, or ``version`` is not
            newer than what is known; else the capabilities of ``version``
            from the ``wire``.
        """
        if _RANK[self.source] > _RANK[CapabilitySource.WIRE] or version not in _ORDER:
            return self
        if self.version in _ORDER and _ORDER.index(version) <= _ORDER.index(self.version):
            return self
        return replace(
            EngineCapabilities.of(version, CapabilitySource.WIRE), duplex_acks=self.duplex_acks
        )

    def for_session(self, *, duplex: bool) -> EngineCapabilities:
        """The same engine, for one session (``duplex=False``: it takes no acks)."""
        return self if duplex == self.duplex_acks else replace(self, duplex_acks=duplex)

    def view(self) -> dict[str, Any]:
        """As JSON for ``/debug/summary`` and the console."""
        return {
            "version": self.version.value,
            "source": self.source.value,
            "bounded_output": self.bounded_output,
            "drops_cancelled_audio": self.drops_cancelled_audio,
            "truncate_needs_audio_item": self.truncate_needs_audio_item,
            "duplex_acks": self.duplex_acks,
        }


def session_is_duplex(path: str, query: Mapping[str, str]) -> bool:
    """Whether the engine serves this socket as a duplex session.

    vLLM-Omni serves ``/v1/duplex`` always as duplex, and ``/v1/realtime`` as
    duplex unless ``?duplex=`` is given and not 1/true/on; anything else goes
    to its non-duplex handler, which refuses ``playback.ack``.
    """
    if path.endswith("/v1/duplex"):
        return True
    flag = query.get("duplex")
    return flag is None or flag.strip().lower() in ("1", "true", "on")


def opens_with_first_message(query: Mapping[str, str]) -> bool:
    """The client said it opens (or resumes) the session with its first message:
    ``autostart`` off or ``resume`` on; the engine sends nothing before it."""
    autostart_off = query.get("autostart", "").strip().lower() in _FALSE
    return autostart_off or query.get("resume", "").strip().lower() in _TRUE


def opens_at_connect(query: Mapping[str, str]) -> bool:
    """Whether the engine opens the session as soon as the socket is up.

    It does with ``?model=`` unless ``autostart`` is off or ``resume`` on; then
    a full engine's ``error`` {resource_exhausted} is its first frame, before
    the client said anything (docs/engine-protocol.md, Opening a session).
    """
    if not query.get("model"):
        return False
    if query.get("autostart", "").strip().lower() in _FALSE:
        return False
    return query.get("resume", "").strip().lower() not in _TRUE
