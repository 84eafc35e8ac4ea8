"""``SessionSettings`` (proxy/core/session_settings.py): one value, the defaults written once.

The core's defaults are the sidecar's: ``SessionSettings()`` is what the default
configuration builds, so a default changed on one side only fails here.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from proxy.core.buffer import BufferLimits
from proxy.core.playback_state import AckMode, PlaybackSettings
from proxy.core.session_settings import OverflowPolicy, SessionSettings
from proxy.edge.state import session_settings
from proxy.settings import OVERFLOW_POLICY_NAMES, PlaybackAck, Settings


def _differences(built: object, core: object, prefix: str = "") -> list[str]:
    found = []
    for f in dataclasses.fields(core):  # type: ignore[arg-type]
        a, b = getattr(built, f.name), getattr(core, f.name)
        if dataclasses.is_dataclass(b):
            found += _differences(a, b, f"{prefix}{f.name}.")
        elif a != b:
            found.append(f"{prefix}{f.name}: the settings say {a!r}, the core {b!r}")
    return found


def test_the_core_defaults_are_what_the_default_configuration_builds() -> None:
    differences = _differences(session_settings(Settings()), SessionSettings())
    assert not differences, (
        "one default, two values; declare the setting with the core's DEFAULT_* constant:\n"
        + "\n".join(differences)
    )


def test_the_comparison_sees_a_default_that_drifted() -> None:
    drifted = dataclasses.replace(SessionSettings(), client_resume_grace=0.0)
    assert _differences(drifted, SessionSettings()) == [
        "client_resume_grace: the settings say 0.0, the core 30.0"
    ]
    nested = dataclasses.replace(SessionSettings(), playback=PlaybackSettings(ack=AckMode.OFF))
    assert _differences(nested, SessionSettings()) == [
        "playback.ack: the settings say <AckMode.OFF: 'off'>, the core <AckMode.AUTO: 'auto'>"
    ]


def test_every_overflow_policy_name_a_setting_accepts_is_a_core_policy() -> None:
    assert OVERFLOW_POLICY_NAMES == tuple(policy.value for policy in OverflowPolicy)


def test_every_playback_ack_a_setting_accepts_is_a_core_mode() -> None:
    assert typing.get_args(PlaybackAck) == tuple(mode.value for mode in AckMode)


def test_held_audio_larger_than_the_output_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="max_paced_audio_bytes"):
        SessionSettings(
            buffer=BufferLimits(max_pending_output_bytes=1000),
            playback=PlaybackSettings(pacing=True, max_paced_audio_bytes=2000),
        )


def test_held_audio_is_not_bounded_by_the_budget_when_pacing_is_off() -> None:
    settings = SessionSettings(
        buffer=BufferLimits(max_pending_output_bytes=1000),
        playback=PlaybackSettings(pacing=False, max_paced_audio_bytes=2000),
    )
    assert settings.playback.max_paced_audio_bytes == 2000


def test_settings_are_a_frozen_value() -> None:
    settings = SessionSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.client_resume_grace = 1.0  # type: ignore[misc]
    assert settings == SessionSettings()
