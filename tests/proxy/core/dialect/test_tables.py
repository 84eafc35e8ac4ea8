"""The dialect's tables against the ``openai`` package and the engine releases."""

from __future__ import annotations

import pytest

from proxy.core.capabilities import EngineVersion
from proxy.core.dialect.tables import BETA, ENGINE_DIALECTS, GA, Flavour, vocabulary
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


def test_the_flavours_are_two() -> None:
    assert [f.value for f in Flavour] == ["ga", "beta"]
