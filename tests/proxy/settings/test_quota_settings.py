"""Quota settings checked before anything starts (docs/design.md, Quotas)."""

from __future__ import annotations

import pytest


def test_a_slot_ttl_under_two_check_intervals_is_a_config_error() -> None:
    """Slots are refreshed at every check: a shorter TTL would expire live sessions' slots."""
    from proxy.errors import ConfigError
    from proxy.settings import load
    from proxy.startup import validate_runtime

    loaded = load(
        None,
        {"OMNI_SIDECAR_QUOTA_SLOT_TTL": "3", "OMNI_SIDECAR_QUOTA_CHECK_INTERVAL": "2"},
        None,
    )
    with pytest.raises(ConfigError) as info:
        validate_runtime(loaded)
    assert info.value.key == "quota_slot_ttl"
    assert "OMNI_SIDECAR_QUOTA_SLOT_TTL" in str(info.value)
