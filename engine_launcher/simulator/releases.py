"""The vLLM-Omni releases ``--engine-version`` reproduces: one row of named capabilities each.

The simulator is another process and imports nothing of the proxy, so it keeps
its own rows; tests/proxy/core/test_engine_releases.py checks them against the
product's table (proxy/core/engine_releases.py): the same releases in the same
order, and every capability both name equal. Use sites read a capability by
name (``config.release.bounded_output``), never compare versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["ENGINE_VERSIONS", "RELEASES", "SIMULATOR_ONLY", "EngineRelease", "release_of"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRelease:
    """What one release does, as the simulator plays it.

    The fields other than ``ack_truncate_flag`` mean what the product table's
    fields of the same name mean (proxy/core/engine_releases.py).

    Attributes:
        ack_truncate_flag: a ``playback.ack``'s ``truncate: true`` truncates.
            0.32 keeps the flag and 0.31 drops it as it parses the ack; 0.30
            dropped it too, but the simulator always modelled it as counting
            there, so this one is the simulator's own (:data:`SIMULATOR_ONLY`).
    """

    version: str
    bounded_output: bool
    drops_cancelled_audio: bool
    truncate_needs_audio_item: bool
    ack_errors_carry_event_id: bool
    audio_only_acks_never_late: bool
    open_rejections_retryable: bool
    openai_realtime_handler: bool
    ack_truncate_flag: bool


#: Capabilities the product's table does not have (the simulator's modelling choices).
SIMULATOR_ONLY: Final = frozenset({"ack_truncate_flag"})

#: Every release ``--engine-version`` takes, oldest first (the first is the default).
RELEASES: Final[tuple[EngineRelease, ...]] = (
    EngineRelease(
        version="0.30",
        bounded_output=False,
        drops_cancelled_audio=False,
        truncate_needs_audio_item=False,
        ack_errors_carry_event_id=True,
        audio_only_acks_never_late=False,
        open_rejections_retryable=False,
        openai_realtime_handler=False,
        ack_truncate_flag=True,
    ),
    EngineRelease(
        version="0.31",
        bounded_output=True,
        drops_cancelled_audio=True,
        truncate_needs_audio_item=False,
        ack_errors_carry_event_id=True,
        audio_only_acks_never_late=False,
        open_rejections_retryable=False,
        openai_realtime_handler=True,
        ack_truncate_flag=False,
    ),
    EngineRelease(
        version="0.32",
        bounded_output=True,
        drops_cancelled_audio=True,
        truncate_needs_audio_item=True,
        ack_errors_carry_event_id=False,
        audio_only_acks_never_late=True,
        open_rejections_retryable=True,
        openai_realtime_handler=True,
        ack_truncate_flag=True,
    ),
)

#: ``--engine-version``'s choices, oldest first.
ENGINE_VERSIONS: Final[tuple[str, ...]] = tuple(r.version for r in RELEASES)

_BY_VERSION: Final[dict[str, EngineRelease]] = {r.version: r for r in RELEASES}


def release_of(version: str) -> EngineRelease:
    """The row of ``version`` (one of :data:`ENGINE_VERSIONS`; KeyError otherwise)."""
    return _BY_VERSION[version]
