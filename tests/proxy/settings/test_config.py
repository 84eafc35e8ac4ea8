"""Settings: precedence defaults < file < env < flags; errors name key and source."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tomllib
from pathlib import Path

import pytest

from engine_launcher.launcher_errors import EngineStartError, LauncherError, RestartBudgetExhausted
from engine_launcher.setting_schema import SettingDoc, type_of
from proxy.core.engine_releases import RELEASES
from proxy.errors import ConfigError, ProxyError
from proxy.settings import (
    KIB,
    LIVE_KEYS,
    MIB,
    SETTING_KEYS,
    SETTINGS,
    EngineConfig,
    EngineConfigError,
    LoadedSettings,
    Settings,
    add_cli_arguments,
    env_name,
    example_config,
    flag_name,
    flag_values,
    format_settings,
    load,
    parse_listen,
)

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "configs" / "omni-sidecar.example.toml"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "omni-sidecar.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def parse_flags(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_cli_arguments(parser)
    return flag_values(parser.parse_args(list(argv)))


def error_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> tuple[str, str]:
    return excinfo.value.key, excinfo.value.source


class TestDefaults:
    def test_defaults_match_design(self) -> None:
        s = load(None, {}, None).settings
        assert s == Settings()
        assert s.listen == "127.0.0.1:8000"
        assert s.admin_listen == "127.0.0.1:9464"
        assert s.upstream is None
        assert s.max_sessions == 64
        assert s.admission_timeout == 0.0
        assert s.max_client_message_bytes == 15 * MIB
        assert (s.max_pending_output_bytes, s.max_pending_output_events) == (2 * MIB, 512)
        assert (s.output_reserve_bytes, s.output_reserve_events) == (64 * KIB, 8)
        assert s.max_close_notice_bytes == 4096
        assert s.max_total_pending_output_bytes == 256 * MIB
        assert s.client_write_buffer_bytes == 64 * KIB
        assert s.overflow_policy == "close_session"
        assert s.interrupt_on_speech_started is False
        assert (s.max_tombstones, s.tombstone_ttl) == (256, 60.0)
        assert s.max_pending_input_bytes == 16 * MIB
        assert s.max_input_audio_rate == 4.0
        assert s.heartbeat_interval == 20.0
        assert s.upstream_connect_timeout == 10.0
        assert s.upstream_close_timeout == 5.0
        assert s.drain_timeout == 30.0
        assert s.handshake_timeout == 10.0
        assert (s.lingering_time, s.lingering_timeout, s.max_lingering_bytes) == (5.0, 2.0, MIB)
        # On by default: 120 s without a client event closes a session (no slot is held forever).
        assert (s.client_idle_timeout, s.max_session_duration, s.max_sessions_per_ip) == (120, 0, 0)
        assert (s.max_client_frame_rate, s.client_frame_burst) == (200.0, 400.0)
        assert (s.api_keys, s.api_keys_file, s.allowed_origins) == ((), None, ())
        assert s.upstream_authorization == "pass-through"
        assert s.forward_query is True
        assert s.upstream_autostart_off is False
        assert s.log_level == "info"
        assert s.engine == EngineConfig()

    def test_engine_defaults(self) -> None:
        e = EngineConfig()
        assert e.kind == "simulator"
        assert (e.host, e.port, e.model, e.python) == ("127.0.0.1", None, None, None)
        assert e.startup_timeout == 1200.0
        assert (e.health_interval, e.health_failures) == (2.0, 3)
        assert (e.max_restarts, e.restart_window, e.stop_grace) == (5, 600.0, 30.0)
        assert e.effective_port() is None

    def test_every_key_has_a_default_source(self) -> None:
        loaded = load(None, {}, None)
        assert set(loaded.sources) == set(SETTING_KEYS)
        assert set(loaded.sources.values()) == {"default"}

    def test_every_setting_field_is_a_key(self) -> None:
        top = {f.name for f in dataclasses.fields(Settings)} - {"engine"}
        engine = {f"engine.{f.name}" for f in dataclasses.fields(EngineConfig)}
        assert set(SETTING_KEYS) == top | engine

    def test_settings_are_frozen_and_hashable(self) -> None:
        s = Settings()
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.max_sessions = 1  # type: ignore[misc]
        assert hash(s) == hash(Settings())


class TestPrecedence:
    """Each row: which sources set the key, and which one must win."""

    FILE = "max_sessions = 10\noverflow_policy = 'fail_response'\n[engine]\nkind = 'command'\n"

    @pytest.mark.parametrize(
        ("use_file", "use_env", "use_flag", "expected", "source"),
        [
            (False, False, False, 64, "default"),
            (True, False, False, 10, "file"),
            (False, True, False, 20, "env OMNI_SIDECAR_MAX_SESSIONS"),
            (True, True, False, 20, "env OMNI_SIDECAR_MAX_SESSIONS"),
            (False, False, True, 30, "flag --max-sessions"),
            (True, False, True, 30, "flag --max-sessions"),
            (True, True, True, 30, "flag --max-sessions"),
        ],
    )
    def test_max_sessions(
        self,
        tmp_path: Path,
        use_file: bool,
        use_env: bool,
        use_flag: bool,
        expected: int,
        source: str,
    ) -> None:
        path = write(tmp_path, "max_sessions = 10\n") if use_file else None
        environ = {"OMNI_SIDECAR_MAX_SESSIONS": "20"} if use_env else {}
        flags = parse_flags("--max-sessions", "30") if use_flag else {}
        loaded = load(flags, environ, path)
        assert loaded.settings.max_sessions == expected
        if source == "file":
            source = f"file {path}"
        assert loaded.sources["max_sessions"] == source

    def test_sources_are_per_key(self, tmp_path: Path) -> None:
        path = write(
            tmp_path, "drain_timeout = 1.5\nforward_query = false\n[engine]\nport = 9000\n"
        )
        environ = {
            "OMNI_SIDECAR_FORWARD_QUERY": "yes",
            "OMNI_SIDECAR_ENGINE_HOST": "::1",
            "OMNI_SIDECAR_HEARTBEAT_INTERVAL": "2.5",
            "PATH": "/usr/bin",
        }
        flags = parse_flags("--no-forward-query", "--engine-kind", "simulator")
        loaded = load(flags, environ, path)
        s = loaded.settings
        assert s.drain_timeout == 1.5
        assert s.heartbeat_interval == 2.5
        assert s.forward_query is False
        assert s.engine.port == 9000
        assert s.engine.host == "::1"
        assert loaded.sources["drain_timeout"] == f"file {path}"
        assert loaded.sources["heartbeat_interval"] == "env OMNI_SIDECAR_HEARTBEAT_INTERVAL"
        assert loaded.sources["forward_query"] == "flag --forward-query"
        assert loaded.sources["engine.port"] == f"file {path}"
        assert loaded.sources["engine.host"] == "env OMNI_SIDECAR_ENGINE_HOST"
        assert loaded.sources["engine.kind"] == "flag --engine-kind"
        assert loaded.sources["max_sessions"] == "default"

    def test_engine_table_precedence(self, tmp_path: Path) -> None:
        path = write(tmp_path, "[engine]\nkind = 'vllm-omni'\nmodel = 'file-model'\n")
        loaded = load({}, {"OMNI_SIDECAR_ENGINE_MODEL": "env-model"}, path)
        assert loaded.settings.engine.model == "env-model"
        assert loaded.settings.engine.effective_port() == 8091
        loaded = load(
            parse_flags("--engine-model", "flag-model"),
            {"OMNI_SIDECAR_ENGINE_MODEL": "env-model"},
            path,
        )
        assert loaded.settings.engine.model == "flag-model"
        assert loaded.sources["engine.model"] == "flag --engine-model"
        assert loaded.sources["engine.kind"] == f"file {path}"

    def test_ignored_env_vars(self) -> None:
        environ = {
            "OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR": "3",
            "OMNI_SIDECAR_CONFIG": "/etc/omni-sidecar.toml",
            "HOME": "/root",
            "omni_sidecar_max_sessions": "1",  # not the prefix: case matters
        }
        assert load(None, environ, None).settings == Settings()

    def test_flags_only_given_appear(self) -> None:
        assert parse_flags() == {}
        assert parse_flags("--log-level", "debug", "--interrupt-on-speech-started") == {
            "log_level": "debug",
            "interrupt_on_speech_started": True,
        }

    def test_typed_flag_values(self) -> None:
        loaded = load({"max_sessions": 3, "api_keys": ["a", "b"], "tombstone_ttl": 2}, {}, None)
        assert loaded.settings.max_sessions == 3
        assert loaded.settings.api_keys == ("a", "b")
        assert loaded.settings.tombstone_ttl == 2.0
        assert isinstance(loaded.settings.tombstone_ttl, float)


class TestParsing:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("1", True),
            ("true", True),
            ("YES", True),
            (" on ", True),
            ("0", False),
            ("False", False),
            ("no", False),
            ("off", False),
        ],
    )
    def test_env_bool(self, text: str, expected: bool) -> None:
        env = {"OMNI_SIDECAR_INTERRUPT_ON_SPEECH_STARTED": text}
        assert load(None, env, None).settings.interrupt_on_speech_started is expected

    def test_env_int_with_underscores(self) -> None:
        env = {"OMNI_SIDECAR_MAX_PENDING_OUTPUT_BYTES": "4_194_304"}
        assert load(None, env, None).settings.max_pending_output_bytes == 4 * MIB

    def test_env_float(self) -> None:
        env = {"OMNI_SIDECAR_ADMISSION_TIMEOUT": "0.25", "OMNI_SIDECAR_DRAIN_TIMEOUT": "7"}
        s = load(None, env, None).settings
        assert (s.admission_timeout, s.drain_timeout) == (0.25, 7.0)

    def test_env_lists(self) -> None:
        env = {
            "OMNI_SIDECAR_API_KEYS": "k1, k2,,k3",
            "OMNI_SIDECAR_ALLOWED_ORIGINS": "https://a.example,https://b.example",
        }
        s = load(None, env, None).settings
        assert s.api_keys == ("k1", "k2", "k3")
        assert s.allowed_origins == ("https://a.example", "https://b.example")

    def test_empty_env_list_and_optional(self) -> None:
        env = {"OMNI_SIDECAR_API_KEYS": "", "OMNI_SIDECAR_API_KEYS_FILE": ""}
        s = load(None, env, None).settings
        assert (s.api_keys, s.api_keys_file) == ((), None)

    def test_env_table(self) -> None:
        env = {"OMNI_SIDECAR_ENGINE_ENV": "CUDA_VISIBLE_DEVICES=0,VLLM_LOGGING_LEVEL=DEBUG,X=a=b"}
        engine = load(None, env, None).settings.engine
        assert engine.env == (
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("VLLM_LOGGING_LEVEL", "DEBUG"),
            ("X", "a=b"),
        )
        assert engine.env_dict() == {
            "CUDA_VISIBLE_DEVICES": "0",
            "VLLM_LOGGING_LEVEL": "DEBUG",
            "X": "a=b",
        }

    def test_file_env_table(self, tmp_path: Path) -> None:
        path = write(tmp_path, '[engine.env]\nHF_HOME = "/cache"\nA = "1"\n')
        assert load(None, {}, path).settings.engine.env_dict() == {"HF_HOME": "/cache", "A": "1"}

    def test_env_argv_is_shell_split(self) -> None:
        env = {
            "OMNI_SIDECAR_ENGINE_EXTRA_ARGS": "--trust-remote-code --stage-overrides '{\"0\": 1}'",
            "OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS": "--chunk-ms 80",
        }
        engine = load(None, env, None).settings.engine
        assert engine.extra_args == ("--trust-remote-code", "--stage-overrides", '{"0": 1}')
        assert engine.simulator_args == ("--chunk-ms", "80")

    def test_flag_argv_and_env(self) -> None:
        flags = parse_flags(
            "--engine-kind",
            "command",
            "--engine-command=my-engine --port 9",
            "--engine-env",
            "A=1",
            "--engine-port",
            "9",
        )
        engine = load(flags, {}, None).settings.engine
        assert engine.kind == "command"
        assert engine.command == ("my-engine", "--port", "9")
        assert engine.env == (("A", "1"),)
        assert engine.effective_port() == 9

    def test_file_lists_and_argv(self, tmp_path: Path) -> None:
        path = write(
            tmp_path,
            'api_keys = ["a", "b"]\n[engine]\nkind = "command"\ncommand = "run --fast"\n'
            'extra_args = ["--x", "y z"]\n',
        )
        s = load(None, {}, path).settings
        assert s.api_keys == ("a", "b")
        assert s.engine.command == ("run", "--fast")
        assert s.engine.extra_args == ("--x", "y z")

    def test_log_level_is_case_insensitive(self) -> None:
        assert load({"log_level": "DEBUG"}, {}, None).settings.log_level == "debug"


class TestUpstream:
    def test_upstream_implies_external(self) -> None:
        loaded = load(None, {"OMNI_SIDECAR_UPSTREAM": "ws://10.0.0.5:8091"}, None)
        s = loaded.settings
        assert s.upstream == "ws://10.0.0.5:8091"
        assert s.engine.kind == "external"
        assert s.engine.upstream == "ws://10.0.0.5:8091"
        assert s.engine.effective_port() == 8091
        assert loaded.sources["engine.kind"] == "env OMNI_SIDECAR_UPSTREAM"
        assert loaded.sources["engine.upstream"] == "env OMNI_SIDECAR_UPSTREAM"

    def test_upstream_client_from_each_source(self, tmp_path: Path) -> None:
        assert Settings().upstream_client == "picows"
        loaded = load(None, {"OMNI_SIDECAR_UPSTREAM_CLIENT": "aiohttp"}, None)
        assert loaded.settings.upstream_client == "aiohttp"
        assert loaded.sources["upstream_client"] == "env OMNI_SIDECAR_UPSTREAM_CLIENT"
        path = write(tmp_path, 'upstream_client = "aiohttp"\n')
        assert load(None, {}, path).settings.upstream_client == "aiohttp"
        flags = parse_flags("--upstream-client", "aiohttp")
        assert load(flags, {}, None).settings.upstream_client == "aiohttp"
        assert "upstream_client" in LIVE_KEYS, "a reload applies it to new sessions"

    def test_upstream_from_flag(self) -> None:
        s = load(parse_flags("--upstream", "wss://engine.example/"), {}, None).settings
        assert s.engine.kind == "external"
        assert s.engine.effective_port() == 443

    def test_external_engine_fills_top_level_upstream(self, tmp_path: Path) -> None:
        path = write(tmp_path, '[engine]\nkind = "external"\nupstream = "ws://h:1"\n')
        assert load(None, {}, path).settings.upstream == "ws://h:1"

    def test_explicit_other_kind_conflicts(self, tmp_path: Path) -> None:
        path = write(tmp_path, '[engine]\nkind = "simulator"\n')
        with pytest.raises(ConfigError) as excinfo:
            load({"upstream": "ws://h:1"}, {}, path)
        assert error_of(excinfo) == ("upstream", "flag --upstream")
        assert f"file {path}" in str(excinfo.value)

    def test_different_engine_upstream_conflicts(self) -> None:
        env = {"OMNI_SIDECAR_ENGINE_UPSTREAM": "ws://a:1", "OMNI_SIDECAR_UPSTREAM": "ws://b:1"}
        with pytest.raises(ConfigError) as excinfo:
            load(None, env, None)
        assert error_of(excinfo) == ("upstream", "env OMNI_SIDECAR_UPSTREAM")

    def test_external_requires_upstream(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load({"engine.kind": "external"}, {}, None)
        assert error_of(excinfo) == ("engine.upstream", "default")

    def test_bad_upstream_url(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load(None, {"OMNI_SIDECAR_UPSTREAM": "http://h:1"}, None)
        assert error_of(excinfo) == ("upstream", "env OMNI_SIDECAR_UPSTREAM")

    def test_constructor_applies_the_same_rule(self) -> None:
        s = Settings(upstream="ws://h:2")
        assert s.engine == EngineConfig(kind="external", upstream="ws://h:2")
        assert Settings(engine=EngineConfig(kind="external", upstream="ws://h:3")).upstream == (
            "ws://h:3"
        )
        with pytest.raises(ConfigError) as excinfo:
            Settings(upstream="ws://h:2", engine=EngineConfig(kind="vllm-omni", model="m"))
        assert error_of(excinfo) == ("upstream", "Settings()")


class TestErrors:
    """Every error names the key and the source of the bad value."""

    def test_message_format(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load(None, {"OMNI_SIDECAR_MAX_SESSIONS": "abc"}, None)
        assert str(excinfo.value) == (
            "max_sessions: invalid integer 'abc' (from env OMNI_SIDECAR_MAX_SESSIONS)"
        )
        assert isinstance(excinfo.value, ProxyError)
        assert isinstance(excinfo.value, ValueError)

    def test_unknown_file_key(self, tmp_path: Path) -> None:
        path = write(tmp_path, "max_session = 3\n")
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, path)
        assert error_of(excinfo) == ("max_session", f"file {path}")
        assert "did you mean 'max_sessions'" in str(excinfo.value)

    def test_unknown_file_engine_key(self, tmp_path: Path) -> None:
        path = write(tmp_path, "[engine]\nmodle = 'x'\n")
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, path)
        assert error_of(excinfo) == ("engine.modle", f"file {path}")

    def test_unknown_env_key(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load(None, {"OMNI_SIDECAR_MAX_SESION": "3"}, None)
        assert error_of(excinfo) == ("max_sesion", "env OMNI_SIDECAR_MAX_SESION")

    def test_unknown_env_engine_key(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load(None, {"OMNI_SIDECAR_ENGINE_MODLE": "x"}, None)
        assert error_of(excinfo) == ("engine.modle", "env OMNI_SIDECAR_ENGINE_MODLE")

    def test_unknown_flag_key(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load({"nope": 1}, {}, None)
        assert error_of(excinfo) == ("nope", "flag --nope")

    @pytest.mark.parametrize(
        ("name", "value", "key"),
        [
            ("OMNI_SIDECAR_MAX_SESSIONS", "abc", "max_sessions"),
            ("OMNI_SIDECAR_MAX_SESSIONS", "1.5", "max_sessions"),
            ("OMNI_SIDECAR_MAX_SESSIONS", "-1", "max_sessions"),
            ("OMNI_SIDECAR_FORWARD_QUERY", "maybe", "forward_query"),
            ("OMNI_SIDECAR_DRAIN_TIMEOUT", "soon", "drain_timeout"),
            ("OMNI_SIDECAR_DRAIN_TIMEOUT", "nan", "drain_timeout"),
            ("OMNI_SIDECAR_DRAIN_TIMEOUT", "-1", "drain_timeout"),
            ("OMNI_SIDECAR_HANDSHAKE_TIMEOUT", "0", "handshake_timeout"),
            ("OMNI_SIDECAR_MAX_PENDING_OUTPUT_BYTES", "0", "max_pending_output_bytes"),
            ("OMNI_SIDECAR_OUTPUT_RESERVE_BYTES", "-5", "output_reserve_bytes"),
            ("OMNI_SIDECAR_LISTEN", "localhost", "listen"),
            ("OMNI_SIDECAR_LISTEN", "127.0.0.1:99999", "listen"),
            ("OMNI_SIDECAR_ADMIN_LISTEN", "::1:9464", "admin_listen"),
            ("OMNI_SIDECAR_OVERFLOW_POLICY", "drop", "overflow_policy"),
            ("OMNI_SIDECAR_LOG_LEVEL", "loud", "log_level"),
            ("OMNI_SIDECAR_UPSTREAM_AUTHORIZATION", "key:", "upstream_authorization"),
            ("OMNI_SIDECAR_UPSTREAM_AUTHORIZATION", "bearer", "upstream_authorization"),
            ("OMNI_SIDECAR_UPSTREAM_CLIENT", "websockets", "upstream_client"),
            ("OMNI_SIDECAR_ENGINE_KIND", "docker", "engine.kind"),
            ("OMNI_SIDECAR_ENGINE_PORT", "70000", "engine.port"),
            ("OMNI_SIDECAR_ENGINE_PORT", "x", "engine.port"),
            ("OMNI_SIDECAR_ENGINE_ENV", "NOVALUE", "engine.env"),
            ("OMNI_SIDECAR_ENGINE_EXTRA_ARGS", "'unclosed", "engine.extra_args"),
            ("OMNI_SIDECAR_ENGINE_HEALTH_FAILURES", "0", "engine.health_failures"),
            ("OMNI_SIDECAR_ENGINE_STARTUP_TIMEOUT", "0", "engine.startup_timeout"),
            ("OMNI_SIDECAR_ENGINE_HEALTH_URL", "ws://h/health", "engine.health_url"),
        ],
    )
    def test_bad_env_value(self, name: str, value: str, key: str) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load(None, {name: value}, None)
        assert error_of(excinfo) == (key, f"env {name}")
        assert str(excinfo.value).startswith(f"{key}: ")
        assert str(excinfo.value).endswith(f"(from env {name})")

    @pytest.mark.parametrize(
        ("text", "key"),
        [
            ("max_sessions = '64'", "max_sessions"),
            ("max_sessions = true", "max_sessions"),
            ("forward_query = 'yes'", "forward_query"),
            ("drain_timeout = '30'", "drain_timeout"),
            ("api_keys = 'k1'", "api_keys"),
            ("api_keys = [1]", "api_keys"),
            ("listen = 8000", "listen"),
            ("overflow_policy = 'drop_all'", "overflow_policy"),
            ("upstream_client = 'curl'", "upstream_client"),
            ("engine = 3", "engine"),
            ("[engine]\nenv = {A = 1}", "engine.env"),
            ("[engine]\nport = 80.5", "engine.port"),
        ],
    )
    def test_bad_file_value(self, tmp_path: Path, text: str, key: str) -> None:
        path = write(tmp_path, text + "\n")
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, path)
        assert error_of(excinfo) == (key, f"file {path}")

    @pytest.mark.parametrize(("kind", "key"), [("vllm-omni", "model"), ("command", "command")])
    def test_missing_required_engine_field(self, tmp_path: Path, kind: str, key: str) -> None:
        # The missing value is at its default; the message names what required it.
        path = write(tmp_path, f"[engine]\nkind = '{kind}'\n")
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, path)
        assert error_of(excinfo) == (f"engine.{key}", "default")
        assert f"set by engine.kind from file {path}" in str(excinfo.value)
        with pytest.raises(ConfigError) as excinfo:
            load(parse_flags("--engine-kind", kind), {}, None)
        assert "set by engine.kind from flag --engine-kind" in str(excinfo.value)

    def test_bad_flag_value(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            load(parse_flags("--max-sessions", "many"), {}, None)
        assert error_of(excinfo) == ("max_sessions", "flag --max-sessions")
        with pytest.raises(ConfigError) as excinfo:
            load(parse_flags("--overflow-policy", "drop"), {}, None)
        assert error_of(excinfo) == ("overflow_policy", "flag --overflow-policy")

    def test_unreadable_and_invalid_file(self, tmp_path: Path) -> None:
        missing = str(tmp_path / "missing.toml")
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, missing)
        assert error_of(excinfo) == ("config", f"file {missing}")
        bad = write(tmp_path, "max_sessions = \n")
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, bad)
        assert error_of(excinfo) == ("config", f"file {bad}")

    def test_constructor_errors(self) -> None:
        with pytest.raises(ConfigError) as excinfo:
            Settings(max_sessions=-1)
        assert error_of(excinfo) == ("max_sessions", "Settings()")
        with pytest.raises(ConfigError):
            Settings(api_keys="k1")  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            Settings(engine="simulator")  # type: ignore[arg-type]
        with pytest.raises(EngineConfigError) as engine_exc:
            EngineConfig(kind="nope")  # type: ignore[arg-type]
        assert engine_exc.value.field == "kind"
        assert isinstance(engine_exc.value, ValueError)


class TestListen:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("127.0.0.1:8000", ("127.0.0.1", 8000)),
            ("0.0.0.0:0", ("0.0.0.0", 0)),
            ("localhost:65535", ("localhost", 65535)),
            ("[::1]:8000", ("::1", 8000)),
            ("[::]:9464", ("::", 9464)),
        ],
    )
    def test_valid(self, text: str, expected: tuple[str, int]) -> None:
        assert parse_listen(text) == expected

    @pytest.mark.parametrize(
        "text",
        ["8000", ":8000", "host:", "host:x", "host:65536", "::1:80", "[]:80", "[h]:80", "a b:1"],
    )
    def test_invalid(self, text: str) -> None:
        with pytest.raises(ValueError):
            parse_listen(text)

    def test_ipv6_setting(self) -> None:
        assert load({"listen": "[::1]:8080"}, {}, None).settings.listen == "[::1]:8080"


class TestPrintConfig:
    def test_one_line_per_key_with_source(self) -> None:
        loaded = load(parse_flags("--max-sessions", "5"), {"OMNI_SIDECAR_DRAIN_TIMEOUT": "3"}, None)
        lines = [line for line in format_settings(loaded).splitlines() if " = " in line]
        assert len(lines) == len(SETTING_KEYS)
        assert [line.removeprefix("# ").split(" = ", 1)[0] for line in lines] == list(SETTING_KEYS)
        assert "max_sessions = 5  # flag --max-sessions" in lines
        assert "drain_timeout = 3.0  # env OMNI_SIDECAR_DRAIN_TIMEOUT" in lines
        assert 'engine.kind = "simulator"  # default' in lines
        # Unset keys are comments, so the whole output stays TOML.
        assert '# upstream = "ws://127.0.0.1:8091"  # (unset) default' in lines

    def test_secrets_are_masked(self) -> None:
        env = {
            "OMNI_SIDECAR_API_KEYS": "sekrit-1,sekrit-2",
            "OMNI_SIDECAR_UPSTREAM_AUTHORIZATION": "key:sekrit-3",
            "OMNI_SIDECAR_UPSTREAM": "wss://user:sekrit-4@engine.example/",
            "OMNI_SIDECAR_ENGINE_ENV": "HF_TOKEN=sekrit-5,CUDA_VISIBLE_DEVICES=1",
        }
        text = format_settings(load(None, env, None))
        assert "sekrit" not in text
        assert 'api_keys = ["***", "***"]  # env OMNI_SIDECAR_API_KEYS' in text
        assert 'upstream_authorization = "key:***"' in text
        assert "wss://user:***@engine.example/" in text
        assert 'engine.env = {HF_TOKEN = "***", CUDA_VISIBLE_DEVICES = "1"}' in text

    def test_output_is_toml(self) -> None:
        loaded = load({"api_keys": ("a",), "engine.env": {"A": "1"}}, {}, None)
        data = tomllib.loads(format_settings(loaded))
        assert data["max_sessions"] == 64
        assert data["engine"]["env"] == {"A": "1"}
        assert "upstream" not in data

    def test_masked_values_are_toml_and_say_so(self) -> None:
        env = {"OMNI_SIDECAR_API_KEYS": "sekrit-1", "OMNI_SIDECAR_ENGINE_ENV": "HF_TOKEN=s"}
        text = format_settings(load(None, env, None))
        data = tomllib.loads(text)
        assert data["api_keys"] == ["***"]
        assert data["engine"]["env"] == {"HF_TOKEN": "***"}
        assert 'api_keys = ["***"]  # env OMNI_SIDECAR_API_KEYS (masked)' in text.splitlines()

    def test_round_trip_through_a_file(self, tmp_path: Path) -> None:
        env = {
            "OMNI_SIDECAR_MAX_SESSIONS": "9",
            "OMNI_SIDECAR_ALLOWED_ORIGINS": "https://a.example",
            "OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS": "--chunk-ms 20",
            "OMNI_SIDECAR_ENGINE_ENV": "A=1",
            "OMNI_SIDECAR_TOMBSTONE_TTL": "1.5",
        }
        first = load(None, env, None)
        path = write(tmp_path, format_settings(first))
        second = load(None, {}, path)
        assert second.settings == first.settings


class TestCli:
    def test_every_key_has_a_flag(self) -> None:
        parser = argparse.ArgumentParser()
        add_cli_arguments(parser)
        help_text = parser.format_help()
        for key in SETTING_KEYS:
            assert flag_name(key) in help_text
            assert env_name(key) in help_text

    def test_names(self) -> None:
        assert flag_name("max_pending_output_bytes") == "--max-pending-output-bytes"
        assert flag_name("engine.deploy_config") == "--engine-deploy-config"
        assert env_name("engine.port") == "OMNI_SIDECAR_ENGINE_PORT"

    def test_boolean_flags(self) -> None:
        assert parse_flags("--upstream-autostart-off") == {"upstream_autostart_off": True}
        loaded = load(parse_flags("--upstream-autostart-off"), {}, None)
        assert loaded.settings.upstream_autostart_off is True
        assert loaded.sources["upstream_autostart_off"] == "flag --upstream-autostart-off"

    def test_other_namespace_attributes_are_ignored(self) -> None:
        ns = argparse.Namespace(config="x.toml", print_config=True, max_sessions="2")
        assert flag_values(ns) == {"max_sessions": "2"}


class TestDeclaration:
    """One declaration per setting; everything else is derived from it."""

    def test_every_setting_is_documented(self) -> None:
        for spec in SETTINGS:
            assert spec.doc.help.strip(), spec.key
            if spec.default is None:
                assert spec.doc.example, f"{spec.key}: unset by default, needs an example"

    def test_committed_example_is_the_generated_one(self) -> None:
        # Regenerate with: python -m proxy.settings --example > configs/omni-sidecar.example.toml
        assert EXAMPLE.read_text(encoding="utf-8") == example_config()

    def test_help_shows_meaning_env_and_default(self) -> None:
        parser = argparse.ArgumentParser()
        add_cli_arguments(parser)
        text = " ".join(parser.format_help().split())
        assert "Concurrent sessions admitted" in text
        assert "[env OMNI_SIDECAR_MAX_SESSIONS; default 64; live]" in text
        assert '[env OMNI_SIDECAR_LISTEN; default "127.0.0.1:8000"]' in text

    def test_live_keys(self) -> None:
        assert {"max_sessions", "api_keys", "allowed_origins", "log_level"} <= LIVE_KEYS
        assert not {"listen", "admin_listen", "upstream"} & LIVE_KEYS
        assert not {k for k in LIVE_KEYS if k.startswith("engine.")}

    @pytest.mark.parametrize(
        ("text", "key", "message"),
        [
            ("max_tombstones = 0", "max_tombstones", "must be >= 1"),
            ("output_reserve_bytes = 2_000\nmax_pending_output_bytes = 1_000",
             "output_reserve_bytes", "must be <= max_pending_output_bytes"),
            ("output_reserve_events = 9\nmax_pending_output_events = 8",
             "output_reserve_events", "must be <= max_pending_output_events"),
            ("[engine]\nport = 70000", "engine.port", "must be <= 65535"),
            ("log_format = 'xml'", "log_format", "unknown value"),
        ],
    )  # fmt: skip
    def test_bounds_the_core_needs_are_declared(
        self, tmp_path: Path, text: str, key: str, message: str
    ) -> None:
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as excinfo:
            load(None, {}, path)
        assert error_of(excinfo) == (key, f"file {path}")
        assert message in excinfo.value.message

    def test_engine_version_takes_auto_and_every_release_of_the_table(self) -> None:
        # Choices that are data (proxy/core/engine_releases.py), declared with the setting.
        releases = tuple(r.version.value for r in RELEASES)
        spec = next(s for s in SETTINGS if s.key == "engine.version")
        assert spec.choices == ("auto", *releases)
        for version in spec.choices:
            env = {"OMNI_SIDECAR_ENGINE_VERSION": version}
            assert load(None, env, None).settings.engine.version == version
        with pytest.raises(ConfigError) as excinfo:
            load(parse_flags("--engine-version", "0.29"), {}, None)
        assert error_of(excinfo) == ("engine.version", "flag --engine-version")
        assert ", ".join(repr(v) for v in spec.choices) in excinfo.value.message
        parser = argparse.ArgumentParser()
        add_cli_arguments(parser)
        assert f"({'|'.join(spec.choices)})" in " ".join(parser.format_help().split())

    def test_declared_choices_are_for_text_settings(self) -> None:
        with pytest.raises(TypeError, match="declared choices need a str setting"):
            type_of(int, SettingDoc(help="A count.", choices=("1", "2")))

    def test_log_format(self) -> None:
        assert load(None, {}, None).settings.log_format == "text"
        assert load(parse_flags("--log-format", "JSON"), {}, None).settings.log_format == "json"


class TestExampleConfig:
    def test_example_values_are_the_defaults(self) -> None:
        loaded = load(None, {}, str(EXAMPLE))
        assert isinstance(loaded, LoadedSettings)
        assert loaded.settings == Settings()
        # and it does set them: every uncommented key comes from the file.
        data = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
        set_keys = [k for k in data if k != "engine"]
        set_keys += [f"engine.{k}" for k in data["engine"]]
        assert len(set_keys) > 30
        for key in set_keys:
            assert loaded.sources[key] == f"file {EXAMPLE}"

    def test_example_documents_every_key(self) -> None:
        text = EXAMPLE.read_text(encoding="utf-8")
        engine_part = text[text.index("\n[engine]\n") :]
        top_part = text[: text.index("\n[engine]\n")]
        for key in SETTING_KEYS:
            name = key.removeprefix("engine.")
            part = engine_part if key.startswith("engine.") else top_part
            assert re.search(rf"^(# )?({name} = |\[engine\.{name}\]$)", part, re.MULTILINE), key

    def test_commented_vllm_omni_example_loads(self, tmp_path: Path) -> None:
        text = EXAMPLE.read_text(encoding="utf-8")
        block = text[text.index("# Replace the [engine] table above with:") :].splitlines()[1:]
        lines = [line.removeprefix("#").removeprefix(" ") for line in block]
        path = write(tmp_path, "\n".join(line for line in lines if not line.startswith("#")))
        engine = load(None, {}, path).settings.engine
        assert engine.kind == "vllm-omni"
        assert engine.model is not None
        assert engine.effective_port() == 8091
        assert engine.env_dict() == {"CUDA_VISIBLE_DEVICES": "0"}


class TestEngineConfig:
    """EngineConfig validates itself and names the field (without ``engine.``)."""

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"kind": "docker"}, "kind"),
            ({"host": " "}, "host"),
            ({"port": 0}, "port"),
            ({"port": True}, "port"),
            ({"model": ""}, "model"),
            ({"python": 3}, "python"),
            ({"extra_args": "--x"}, "extra_args"),
            ({"extra_args": ("--x", 1)}, "extra_args"),
            ({"env": "A=1"}, "env"),
            ({"env": (("A",),)}, "env"),
            ({"env": (("", "1"),)}, "env"),
            ({"env": (("A=B", "1"),)}, "env"),
            ({"env": (("A", 1),)}, "env"),
            ({"env": (("A", "1"), ("A", "2"))}, "env"),
            ({"upstream": 5}, "upstream"),
            ({"upstream": "ws://h:notaport"}, "upstream"),
            ({"upstream": "ws:///path"}, "upstream"),
            ({"health_url": "ftp://h/health"}, "health_url"),
            ({"startup_timeout": "10"}, "startup_timeout"),
            ({"startup_timeout": float("inf")}, "startup_timeout"),
            ({"startup_timeout": 10**400}, "startup_timeout"),
            ({"health_interval": 0}, "health_interval"),
            ({"stop_grace": -1}, "stop_grace"),
            ({"health_failures": 1.5}, "health_failures"),
            ({"max_restarts": -1}, "max_restarts"),
            ({"kind": "vllm-omni"}, "model"),
            ({"kind": "command"}, "command"),
            ({"kind": "external"}, "upstream"),
        ],
    )
    def test_invalid(self, kwargs: dict[str, object], field: str) -> None:
        with pytest.raises(EngineConfigError) as excinfo:
            EngineConfig(**kwargs)  # type: ignore[arg-type]
        assert excinfo.value.field == field
        assert str(excinfo.value).startswith(f"{field}: ")

    def test_normalises_sequences_and_numbers(self) -> None:
        e = EngineConfig(
            kind="command",
            command=["run", "it"],  # type: ignore[arg-type]
            env={"A": "1", "B": "2"},  # type: ignore[arg-type]
            stop_grace=0,
            startup_timeout=5,
        )
        assert e.command == ("run", "it")
        assert e.env == (("A", "1"), ("B", "2"))
        assert isinstance(e.stop_grace, float)
        assert isinstance(e.startup_timeout, float)
        assert hash(e) == hash(dataclasses.replace(e))

    def test_effective_values(self) -> None:
        assert EngineConfig(port=9100).effective_port() == 9100
        assert EngineConfig(kind="vllm-omni", model="m").effective_port() == 8091
        assert EngineConfig(kind="command", command=("x",)).effective_port() is None
        assert EngineConfig(kind="external", upstream="ws://h").effective_port() == 80
        assert EngineConfig(python="/opt/py").effective_python() == "/opt/py"
        assert EngineConfig().effective_python() == sys.executable


class TestErrorTypes:
    def test_tree(self) -> None:
        assert issubclass(ConfigError, ProxyError) and issubclass(ConfigError, ValueError)
        assert issubclass(EngineStartError, LauncherError)
        assert issubclass(RestartBudgetExhausted, LauncherError)
        assert not issubclass(LauncherError, ProxyError)

    def test_data(self) -> None:
        err = ConfigError("k", "bad", "default").with_source("env X")
        assert (err.key, err.message, err.source) == ("k", "bad", "env X")
        assert EngineStartError("exited", returncode=3).returncode == 3
        budget = RestartBudgetExhausted("too many", restarts=6, window=600.0)
        assert (budget.restarts, budget.window) == (6, 600.0)


def test_playback_settings_reach_the_core() -> None:
    from proxy.core.playback import AckMode
    from proxy.edge.state import session_settings

    playback = session_settings(
        Settings(
            playback_pacing=True,
            max_audio_lead=0.3,
            max_paced_audio_bytes=1000,
            playback_ack="always",
            playback_ack_interval=1.5,
        )
    ).playback
    assert (playback.pacing, playback.max_audio_lead, playback.max_paced_audio_bytes) == (
        True,
        0.3,
        1000,
    )
    assert (playback.ack, playback.ack_interval) == (AckMode.ALWAYS, 1.5)
