"""The dialect's tables against the ``openai`` package and the engine releases."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.core.capabilities import EngineVersion
from proxy.core.dialect.tables import BETA, ENGINE_DIALECTS, GA, Flavour, vocabulary
from proxy.core.engine_releases import RELEASES, EngineRelease
from tests.integration.openai_models import ServerEvents

pytest.importorskip("openai")


@pytest.mark.parametrize("vocab", [GA, BETA], ids=["ga", "beta"])
def test_every_type_sent_is_one_the_openai_package_has_a_model_for(vocab: object) -> None:
    assert vocabulary(vocab.flavour) is vocab  # type: ignore[attr-defined]
    known = set(ServerEvents(vocab.flavour.value).models)  # type: ignore[attr-defined]
    assert vocab.types <= known  # type: ignore[attr-defined]
    assert set(vocab.renames.values()) <= vocab.types  # type: ignore[attr-defined]
    assert vocab.audio_delta in vocab.types  # type: ignore[attr-defined]


def test_every_engine_release_has_a_table_and_none_refuses_a_stock_turn_detection() -> None:
    assert set(ENGINE_DIALECTS) == set(EngineVersion)
    for table in ENGINE_DIALECTS.values():
        assert set(table.turn_detection) >= {"server_vad", "semantic_vad"}
        assert "create_response" not in table.turn_detection_fields  # the engine refuses it
        assert {"response_not_active", "unsupported_audio_truncate"} <= table.hidden_errors


@pytest.mark.parametrize("release", RELEASES, ids=[r.version.value for r in RELEASES])
def test_a_releases_dialect_is_what_its_row_says(release: EngineRelease) -> None:
    table = ENGINE_DIALECTS[release.version]
    assert table.version is release.version
    assert ("semantic_vad_unavailable" in table.hidden_errors) is release.semantic_vad
    # Nothing else differs between releases: a new row with no new capability needs
    # no edit of the tables.
    oldest = ENGINE_DIALECTS[RELEASES[0].version]
    same = dataclasses.replace(table, version=oldest.version, hidden_errors=oldest.hidden_errors)
    assert same == oldest


def test_an_unknown_engine_gets_the_oldest_releases_dialect() -> None:
    assert ENGINE_DIALECTS[EngineVersion.UNKNOWN] == ENGINE_DIALECTS[RELEASES[0].version]


def test_the_flavours_are_two() -> None:
    assert [f.value for f in Flavour] == ["ga", "beta"]
