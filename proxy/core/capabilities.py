"""What the engine does, as a small value the sessions read.

vLLM-Omni changed behaviour a proxy depends on between releases and has no
version endpoint: the version comes from ``config``, then ``preflight``, then
what a session saw on the ``wire`` (never overriding the first two, only
moving up), else ``unknown`` (behave as the oldest release); docs/design.md,
Engine capabilities. The releases and what each does are rows of
:mod:`proxy.core.engine_releases`; this module only derives from them.
Sans-I/O; label values are the enums' values.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from proxy.core.engine_releases import RELEASES, EngineVersion, WireSign, release_of

__all__ = [
    "CapabilitySource",
    "EngineCapabilities",
    "EngineVersion",
    "WireSign",
    "opens_at_connect",
    "opens_with_first_message",
    "parse_version",
    "session_is_duplex",
]


class CapabilitySource(enum.Enum):
    """Where the version came from (the ``source`` label), weakest first."""

    UNKNOWN = "unknown"
    WIRE = "wire"
    PREFLIGHT = "preflight"
    CONFIG = "config"


#: Each release's place, oldest first (the wire only moves the version up).
_AGE: Final[dict[EngineVersion, int]] = {r.version: age for age, r in enumerate(RELEASES)}
_RANK: Final = {source: rank for rank, source in enumerate(CapabilitySource)}
_MAJOR_MINOR: Final = re.compile(r"^\s*v?(\d+)\.(\d+)")


def _major_minor(text: str) -> tuple[int, int]:
    match = _MAJOR_MINOR.match(text)
    assert match is not None, text
    return int(match.group(1)), int(match.group(2))


#: The releases as (major, minor), newest first, for :func:`parse_version`.
_NEWEST_FIRST: Final[tuple[tuple[tuple[int, int], EngineVersion], ...]] = tuple(
    (_major_minor(r.version.value), r.version) for r in reversed(RELEASES)
)
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def parse_version(text: str | None) -> EngineVersion:
    """The behaviour of a ``vllm-omni`` release version (``"0.32.0rc1"`` → 0.32).

    A release between two known ones behaves as the older, one newer than the
    newest known as the newest, one older than the oldest as the oldest; text
    that is not a version is ``UNKNOWN``.
    """
    match = _MAJOR_MINOR.match(text or "")
    if match is None:
        return EngineVersion.UNKNOWN
    found = (int(match.group(1)), int(match.group(2)))
    for known, version in _NEWEST_FIRST:
        if found >= known:
            return version
    return _NEWEST_FIRST[-1][1]


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What the engine does, derived from its version's row (see :meth:`of`).

    The capabilities a session reads are fields (attribute reads on a frozen
    value), copied from the row of :mod:`proxy.core.engine_releases`, which
    says what each means and which release has it.

    Attributes:
        version: the behaviour assumed.
        source: where ``version`` came from.
        bounded_output: the engine bounds each session's output itself; a
            sidecar that stops reading to push back gets the session closed.
        drops_cancelled_audio: the engine removes queued audio of a cancelled
            response before sending it; the sidecar filters anyway.
        truncate_needs_audio_item: a truncation must name an item that
            produced audio, else ``bad_event``; the sidecar then truncates
            only items whose audio it relayed.
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
        """The capabilities of ``version`` (``UNKNOWN``: those of the oldest release)."""
        if version is EngineVersion.UNKNOWN:
            source = CapabilitySource.UNKNOWN
        release = release_of(version)
        return cls(
            version=version,
            source=source,
            bounded_output=release.bounded_output,
            drops_cancelled_audio=release.drops_cancelled_audio,
            truncate_needs_audio_item=release.truncate_needs_audio_item,
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
        if _RANK[self.source] > _RANK[CapabilitySource.WIRE] or version not in _AGE:
            return self
        if self.version in _AGE and _AGE[version] <= _AGE[self.version]:
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
