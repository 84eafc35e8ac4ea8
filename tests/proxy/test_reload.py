"""``Sidecar.reload`` without sockets: what changes, what is kept, what is counted.

The reload is driven with a fake loader (what the CLI's closure returns), so
each rule is checked on the objects new sessions and handshakes read:
``ProxyState.settings``/``session_settings``/``auth`` and ``Admission``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.server import Sidecar
from proxy.settings import EngineConfig, LoadedSettings, load


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    """A reload reconfigures logging; leave the root logger as it was."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sidecar.toml"
    path.write_text(text)
    return str(path)


def _sidecar(tmp_path: Path, text: str) -> tuple[Sidecar, list[str]]:
    path = _file(tmp_path, text)
    flags = {"listen": "127.0.0.1:0"}
    sidecar = Sidecar(load(flags, {}, path).settings, environ={})
    texts = [text]

    def reload() -> LoadedSettings:
        Path(path).write_text(texts[-1])
        return load(flags, {}, path)

    sidecar.reloader = reload
    return sidecar, texts


def _count(sidecar: Sidecar, result: str) -> float:
    value = sidecar.registry.get_sample_value(
        "omni_sidecar_config_reloads_total", {"result": result}
    )
    assert value is not None
    return value


def test_live_settings_apply_and_the_rest_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sidecar, texts = _sidecar(tmp_path, "max_sessions = 4\n")
    texts.append(
        "max_sessions = 2\nmax_tombstones = 9\napi_keys = ['k']\nadmin_listen = '127.0.0.1:1'\n"
        "log_level = 'debug'\n[engine]\nhealth_interval = 7.5\n"
    )
    with caplog.at_level(logging.INFO, logger="omni_sidecar"):
        assert sidecar.reload() is True
    state = sidecar.state
    assert state.admission.max_sessions == 2
    assert state.settings.max_sessions == sidecar.settings.max_sessions == 2
    assert state.session_settings.max_tombstones == 9
    assert state.settings.api_keys == ("k",)
    assert not state.auth.check({}, ()).ok
    assert state.auth.check({"Authorization": "Bearer k"}, ()).ok
    # Not live: kept as they were, and named.
    assert sidecar.settings.admin_listen == "127.0.0.1:9464"
    assert sidecar.settings.engine.health_interval == EngineConfig().health_interval != 7.5
    assert sidecar.settings.listen == "127.0.0.1:0"  # the flag still wins
    assert logging.getLogger().level == logging.DEBUG
    (line,) = [r.getMessage() for r in caplog.records if "config reload" in r.getMessage()]
    assert "applied max_sessions, max_tombstones, api_keys, log_level" in line
    assert "left as it was: admin_listen, engine.health_interval" in line
    assert (_count(sidecar, "applied"), _count(sidecar, "rejected")) == (1, 0)


def test_a_rejected_file_changes_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sidecar, texts = _sidecar(tmp_path, "max_sessions = 4\n")
    before = (sidecar.settings, sidecar.state.session_settings, sidecar.state.auth)
    texts.append("max_sessions = 1\noutput_reserve_events = 600\n")
    with caplog.at_level(logging.INFO, logger="omni_sidecar"):
        assert sidecar.reload() is False
    assert (sidecar.settings, sidecar.state.session_settings, sidecar.state.auth) == before
    assert sidecar.state.admission.max_sessions == 4
    (line,) = [r.getMessage() for r in caplog.records if "config reload" in r.getMessage()]
    assert "rejected" in line and "output_reserve_events" in line
    assert (_count(sidecar, "applied"), _count(sidecar, "rejected")) == (0, 1)


def test_an_empty_keys_file_is_rejected_and_auth_stays(tmp_path: Path) -> None:
    sidecar, texts = _sidecar(tmp_path, "api_keys = ['old']\n")
    empty = tmp_path / "keys"
    empty.write_text("\n")
    texts.append(f"api_keys_file = '{empty}'\n")
    assert sidecar.reload() is False
    assert sidecar.state.settings.api_keys == ("old",)
    assert _count(sidecar, "rejected") == 1


def _key_name(sidecar: Sidecar, key: str) -> str | None:
    result = sidecar.state.auth.check({"Authorization": f"Bearer {key}"}, [])
    return result.key_name if result.ok else None


def test_a_reload_renames_keys_for_new_sessions(tmp_path: Path) -> None:
    """docs/design.md, Usage: names come from the file as it is at the reload."""
    keys = tmp_path / "keys"
    keys.write_text("k1 name=alpha\nk2\n")
    sidecar, texts = _sidecar(tmp_path, f"api_keys_file = '{keys}'\n")
    assert (_key_name(sidecar, "k1"), _key_name(sidecar, "k2")) == ("alpha", "unnamed")
    keys.write_text("k1 name=alpha\nk2 name=beta\n")
    texts.append(texts[-1])
    assert sidecar.reload() is True
    assert _key_name(sidecar, "k2") == "beta"
    labels = {"key": "beta", "direction": "in"}
    value = sidecar.registry.get_sample_value("omni_sidecar_usage_audio_seconds_total", labels)
    assert value == 0.0  # the new name's series exist from the reload on


def test_an_unknown_field_in_the_keys_file_is_rejected_and_names_stay(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 name=alpha\n")
    sidecar, texts = _sidecar(tmp_path, f"api_keys_file = '{keys}'\n")
    keys.write_text("k1 name=omega\nk2 quota=5\n")
    texts.append(texts[-1])
    assert sidecar.reload() is False
    assert _key_name(sidecar, "k1") == "alpha" and _key_name(sidecar, "k2") is None
    assert _count(sidecar, "rejected") == 1
