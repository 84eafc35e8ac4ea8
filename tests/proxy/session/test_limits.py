"""``RelayLimits`` (proxy/session/limits.py): the shell's bounds, one value from the settings."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.session.limits import RelayLimits
from proxy.settings import Settings

#: Each limit and the setting it comes from.
FROM_SETTING = {
    "close_timeout": "close_timeout",
    "drain_timeout": "drain_timeout",
    "upstream_close_timeout": "upstream_close_timeout",
    "write_buffer_bytes": "client_write_buffer_bytes",
    "max_session_duration": "max_session_duration",
    "client_idle_timeout": "client_idle_timeout",
    "heartbeat_interval": "heartbeat_interval",
}


def test_every_limit_comes_from_its_setting() -> None:
    assert {f.name for f in dataclasses.fields(RelayLimits)} == set(FROM_SETTING)
    settings = dataclasses.replace(
        Settings(),
        close_timeout=1.5,
        drain_timeout=2.5,
        upstream_close_timeout=3.5,
        client_write_buffer_bytes=12345,
        max_session_duration=600.0,
        client_idle_timeout=60.0,
        heartbeat_interval=7.0,
    )
    limits = RelayLimits.from_settings(settings)
    for name, setting in FROM_SETTING.items():
        assert getattr(limits, name) == getattr(settings, setting), name


def test_timers_are_off_unless_given() -> None:
    limits = RelayLimits(close_timeout=1.0, drain_timeout=1.0, upstream_close_timeout=1.0)
    assert (limits.max_session_duration, limits.client_idle_timeout) == (0.0, 0.0)
    assert limits.heartbeat_interval == 0.0
    assert limits.write_buffer_bytes > 0


def test_limits_are_a_frozen_value() -> None:
    limits = RelayLimits(close_timeout=1.0, drain_timeout=1.0, upstream_close_timeout=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.close_timeout = 2.0  # type: ignore[misc]
