"""Settings: one declaration per setting, loaded from file, environment and flags.

The other layers import from here, not from the modules, each of which has
one job: ``proxy_settings`` (the sidecar's ``Settings``), ``values`` (one
value), ``load`` (defaults < file < environment < flags) and ``render``
(flags, ``--print-config``, the example config, docs/configuration.md). The
``[engine]`` table and the declaration helper are the launcher's
(``engine_launcher.engine_config``, ``engine_launcher.setting_schema``).
docs/design.md, Settings.
"""

from __future__ import annotations

from engine_launcher.engine_config import (
    ENGINE_KINDS,
    ENGINE_VERSIONS,
    MAX_REPLICAS,
    PROBE_KINDS,
    EngineConfig,
    EngineConfigError,
    EngineKind,
    ProbeKind,
)
from engine_launcher.setting_schema import (
    CONFIG_PATH_ENV,
    ENV_PREFIX,
    KIB,
    MIB,
    TESTS_ENV_PREFIX,
    SettingSpec,
    env_name,
    flag_name,
)
from proxy.settings.load import LoadedSettings, load
from proxy.settings.proxy_settings import (
    DEFAULT_ADMIN_LISTEN,
    DEFAULT_LISTEN,
    LIVE_KEYS,
    LOG_FORMATS,
    LOG_LEVELS,
    OVERFLOW_POLICY_NAMES,
    SETTING_KEYS,
    SETTINGS,
    TRACING_MODES,
    LogFormat,
    LogLevel,
    OverflowPolicyName,
    PlaybackAck,
    Settings,
    TracingMode,
    UpstreamClient,
    setting_value,
)
from proxy.settings.render import (
    add_cli_arguments,
    configuration_markdown,
    example_config,
    flag_values,
    format_settings,
)
from proxy.settings.values import parse_listen

__all__ = [
    "CONFIG_PATH_ENV",
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_LISTEN",
    "ENGINE_KINDS",
    "ENGINE_VERSIONS",
    "ENV_PREFIX",
    "KIB",
    "LIVE_KEYS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_REPLICAS",
    "MIB",
    "OVERFLOW_POLICY_NAMES",
    "PROBE_KINDS",
    "SETTINGS",
    "SETTING_KEYS",
    "TESTS_ENV_PREFIX",
    "TRACING_MODES",
    "EngineConfig",
    "EngineConfigError",
    "EngineKind",
    "LoadedSettings",
    "LogFormat",
    "LogLevel",
    "OverflowPolicyName",
    "PlaybackAck",
    "ProbeKind",
    "SettingSpec",
    "Settings",
    "TracingMode",
    "UpstreamClient",
    "add_cli_arguments",
    "configuration_markdown",
    "env_name",
    "example_config",
    "flag_name",
    "flag_values",
    "format_settings",
    "load",
    "parse_listen",
    "setting_value",
]
