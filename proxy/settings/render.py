"""Everything shown to people, rendered from the declarations.

:func:`add_cli_arguments` / :func:`flag_values` (a flag per setting for
``serve``), :func:`format_settings` (``serve --print-config``),
:func:`example_config` (``configs/omni-sidecar.example.toml``) and
:func:`configuration_markdown` (``docs/configuration.md``). docs/design.md, Settings.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import tomllib
from typing import Final

from engine_launcher.setting_schema import KIB, MIB, SettingSpec, ValueType
from proxy.settings.load import LoadedSettings
from proxy.settings.proxy_settings import (
    ENGINE_SPECS,
    SETTING_KEYS,
    SETTINGS,
    TOP_SPECS,
    mask_url,
    setting_value,
)

__all__ = [
    "add_cli_arguments",
    "configuration_markdown",
    "example_config",
    "flag_values",
    "format_settings",
]

_DEST_TO_KEY: Final[dict[str, str]] = {key.replace(".", "_"): key for key in SETTING_KEYS}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a ``--key-with-dashes`` flag for every setting to ``parser``.

    Flags default to ``argparse.SUPPRESS``, so only the flags given appear in
    the namespace; pass it through :func:`flag_values` to :func:`load`.
    Booleans get ``--x/--no-x``; other values are taken as text and parsed by
    :func:`load` like env values, so a bad value raises ``ConfigError`` naming
    the flag. Engine fields get ``--engine-<field>`` (``--engine-kind``,
    ``--engine-model``, ...). Each flag's help is the setting's meaning, its
    env var and its default.

    Args:
        parser: The parser to extend; the flags go in a "settings" group.
    """
    group = parser.add_argument_group(
        "settings",
        "override the config file and OMNI_SIDECAR_* env vars (docs/design.md, Settings); "
        "[live] = a SIGHUP reload applies a change at once",
    )
    for spec in SETTINGS:
        dest = spec.key.replace(".", "_")
        default = _format_value(spec.default, table=spec.type is ValueType.ENV)
        live = "; live" if spec.doc.live else ""
        choices = f" ({'|'.join(spec.choices)})" if spec.choices else ""
        help_text = f"{spec.doc.help}{choices} [env {spec.env}; default {default}{live}]"
        help_text = help_text.replace("%", "%%")
        if spec.type is ValueType.BOOL:
            group.add_argument(
                spec.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                spec.flag,
                dest=dest,
                metavar=spec.metavar,
                default=argparse.SUPPRESS,
                help=help_text,
            )


def flag_values(namespace: argparse.Namespace) -> dict[str, object]:
    """Return the setting flags present in ``namespace``, keyed by setting key.

    Args:
        namespace: The result of ``parser.parse_args()`` after
            :func:`add_cli_arguments`; other attributes are ignored.

    Returns:
        ``{key: value}`` for each flag given, ready for :func:`load`.
    """
    found = vars(namespace)
    return {key: found[dest] for dest, key in _DEST_TO_KEY.items() if dest in found}


def _is_unset(value: object) -> bool:
    return value is None


def format_settings(loaded: LoadedSettings) -> str:
    """Render settings for ``--print-config``: TOML that ``--config`` accepts back.

    One ``key = value  # source`` per line (engine keys as dotted
    ``engine.<field>`` keys, which TOML reads as the ``[engine]`` table).
    Unset keys are comments: ``# upstream = "ws://..."  # (unset) default``,
    showing the declared example. Secrets stay valid TOML but are masked, and
    their line says so: each API key is shown as ``"***"``, as are the key of
    ``upstream_authorization = "key:..."``, URL passwords and ``engine.env``
    values whose name looks secret (``*TOKEN*``, ``*KEY*``, ``*SECRET*``,
    ``*PASS*``).

    Args:
        loaded: What :func:`load` returned.

    Returns:
        The lines, joined with newlines, ending with a newline.
    """
    settings = loaded.settings
    lines = [
        "# omni-sidecar settings (serve --print-config): valid TOML for --config;",
        '# values marked "masked" had secrets replaced by "***".',
    ]
    for spec in SETTINGS:
        value = setting_value(settings, spec.key)
        source = loaded.sources.get(spec.key, "default")
        if _is_unset(value):
            example = spec.doc.example or '""'
            lines.append(f"# {spec.key} = {example}  # (unset) {source}")
            continue
        shown = _mask(spec, value)
        note = " (masked)" if shown != value else ""
        text = _format_value(shown, table=spec.type is ValueType.ENV)
        lines.append(f"{spec.key} = {text}  # {source}{note}")
    return "\n".join(lines) + "\n"


_SECRET_WORDS: Final = ("TOKEN", "KEY", "SECRET", "PASS", "CREDENTIAL", "AUTH")


def _mask(spec: SettingSpec, value: object) -> object:
    if spec.doc.mask is not None:
        return spec.doc.mask(value)
    if spec.key in ("engine.upstream", "engine.health_url"):
        return mask_url(value)  # type: ignore[arg-type]
    if spec.type is ValueType.ENV:
        assert isinstance(value, tuple)
        return tuple(
            (name, "***" if any(w in name.upper() for w in _SECRET_WORDS) else val)
            for name, val in value
        )
    return value


def _format_value(value: object, *, underscores: bool = False, table: bool = False) -> str:
    """TOML text of a value (``(unset)`` for ``None``, which TOML cannot express).

    ``table`` renders ``(name, value)`` pairs (``engine.env``) as an inline table.
    """
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:_}" if underscores and abs(value) >= 10_000 else repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    assert isinstance(value, tuple)
    if table:
        items = [f"{name} = {json.dumps(val, ensure_ascii=False)}" for name, val in value]
        return "{" + ", ".join(items) + "}"
    return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"


def _size_note(spec: SettingSpec) -> str:
    value = spec.default
    if spec.doc.unit != "bytes" or not isinstance(value, int) or value < KIB:
        return ""
    if value % MIB == 0:
        return f" ({value // MIB} MiB)"
    if value % KIB == 0:
        return f" ({value // KIB} KiB)"
    return ""


_EXAMPLE_HEADER: Final = """\
# omni-sidecar example configuration (docs/design.md, Settings).
#
# Generated from the settings' declarations in proxy/settings/ by
#   .venv/bin/python -m proxy.settings --example > configs/omni-sidecar.example.toml
# (a test checks that this file matches); edit the declarations, not this file.
#
# Every value below is the built-in default, so this file changes nothing as
# it stands; edit what you need. Keys that are unset by default are commented
# out. Each key may also be set by env OMNI_SIDECAR_<KEY> (the [engine] table:
# OMNI_SIDECAR_ENGINE_<KEY>) or by the flag --key-with-dashes; precedence is
# defaults < this file < env < flags. `omni-sidecar serve --print-config` shows
# every value and where it came from. SIGHUP reloads this file: settings
# marked "reload: live" apply to new sessions at once, the others need a
# restart.
#
# Units: durations are float seconds, sizes are int bytes, counts are ints.
# 1 KiB = 1024 bytes, 1 MiB = 1_048_576 bytes.
"""

_EXAMPLE_TRAILER: Final = """\

# --- Example: a real vLLM-Omni engine ---------------------------------------
# Replace the [engine] table above with:
#
# [engine]
# kind = "vllm-omni"
# model = "openbmb/MiniCPM-o-4_5"
# port = 8091
# # A bare file name is looked up in the vllm_omni/deploy/ package folder.
# deploy_config = "minicpmo_4_5.yaml"
# extra_args = ["--trust-remote-code"]
# startup_timeout = 1200.0
#
# [engine.env]
# CUDA_VISIBLE_DEVICES = "0"
"""


def _heading(title: str) -> str:
    return f"# --- {title} ".ljust(78, "-")


def _example_entry(spec: SettingSpec) -> list[str]:
    lines = [f"# {line}" for line in textwrap.wrap(spec.doc.help, 76, break_on_hyphens=False)]
    unit = f"Unit: {spec.doc.unit}{_size_note(spec)}. " if spec.doc.unit else ""
    reload = "live" if spec.doc.live else "restart"
    lines.append(f"# {unit}Reload: {reload}.")
    if _is_unset(spec.default):
        lines.append(f"# {spec.name} = {spec.doc.example or '...'}")
    else:
        lines.append(f"{spec.name} = {_format_value(spec.default, underscores=True)}")
    return lines


def example_config() -> str:
    """Return the example config file: every setting, its meaning and default.

    ``configs/omni-sidecar.example.toml`` is this text (a test checks it);
    ``python -m proxy.settings --example`` prints it.
    """
    out = [_EXAMPLE_HEADER]
    section = None
    for spec in TOP_SPECS.values():
        if spec.doc.section != section:
            section = spec.doc.section
            out.append(_heading(section or "Other"))
            out.append("")
        out.extend(_example_entry(spec))
        out.append("")
    out.append(_heading("Engine"))
    out.append("")
    out.append("[engine]")
    tables = [s for s in ENGINE_SPECS.values() if s.type is ValueType.ENV]
    for spec in ENGINE_SPECS.values():
        if spec.type is ValueType.ENV:
            continue
        out.extend(_example_entry(spec))
        out.append("")
    for spec in tables:  # sub-tables must come after the table's plain keys
        out.extend(f"# {line}" for line in textwrap.wrap(spec.doc.help, 76, break_on_hyphens=False))
        out.append(f"# Reload: {'live' if spec.doc.live else 'restart'}.")
        out.append(f"[engine.{spec.name}]")
        example = tomllib.loads(f"x = {spec.doc.example or '{}'}")["x"]
        out.extend(f"# {name} = {json.dumps(val)}" for name, val in example.items())
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n" + _EXAMPLE_TRAILER


# --------------------------------------------------------------------------
# docs/configuration.md

SETTINGS_MARKDOWN_COMMAND: Final = "python -m proxy.settings --markdown > docs/configuration.md"

_MARKDOWN_HEADER: Final = f"""\
<!-- Generated by `{SETTINGS_MARKDOWN_COMMAND}` from the
declarations in proxy/settings/; do not edit (a test checks it is current). -->

# Configuration reference

Every setting of omni-sidecar, generated from its one declaration
(docs/design.md, Settings). Each key has the same name in every source:
the TOML key `max_sessions` is the env var `OMNI_SIDECAR_MAX_SESSIONS` and the
flag `--max-sessions`; the `[engine]` table's keys are
`OMNI_SIDECAR_ENGINE_<KEY>` and `--engine-<key>`. Precedence is
defaults < config file (`--config`) < environment < flags, and
`omni-sidecar serve --print-config` shows every value in effect and where it
came from. `configs/omni-sidecar.example.toml` is the same list as a config
file.

Durations are float seconds, sizes int bytes (1 KiB = 1024 bytes,
1 MiB = 1_048_576 bytes), counts ints. In the environment and in flags,
booleans are `1/0`, `true/false`, `yes/no` or `on/off`, lists are
comma-separated, `engine.env` is `K=V,K2=V2`, argument lists are split like a
shell command line, and an empty value unsets an optional key.

*Reload* says whether a SIGHUP reload applies a change at once (to new
sessions and handshakes: "yes") or whether it waits for a restart ("no").
"""


def _cell(text: str) -> str:
    """Table cell text: pipes escaped, lines joined."""
    return " ".join(text.split()).replace("|", "\\|")


def _type_text(spec: SettingSpec) -> str:
    if spec.choices:
        text = " | ".join(f"`{json.dumps(c)}`" for c in spec.choices)
    else:
        text = spec.type.value
    doc = spec.doc
    bounds: list[str] = []
    if doc.positive:
        bounds.append("> 0")
    if doc.minimum is not None and doc.maximum is not None:
        bounds.append(f"{doc.minimum:g} … {doc.maximum:g}")
    elif doc.minimum is not None:
        bounds.append(f">= {doc.minimum:g}")
    elif doc.maximum is not None:
        bounds.append(f"<= {doc.maximum:g}")
    return text + "".join(f", {b}" for b in bounds)


def _default_text(spec: SettingSpec) -> str:
    if _is_unset(spec.default):
        example = f" (e.g. `{spec.doc.example}`)" if spec.doc.example else ""
        return "unset" + example
    value = _format_value(spec.default, underscores=True, table=spec.type is ValueType.ENV)
    unit = f" {spec.doc.unit}" if spec.doc.unit not in ("", "count") else ""
    return f"`{value}`{unit}{_size_note(spec)}"


def _markdown_table(specs: list[SettingSpec]) -> list[str]:
    lines = [
        "| key | env / flag | type | default | reload | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for spec in specs:
        flag = f"`{spec.flag}`" if spec.type is ValueType.BOOL else f"`{spec.flag} {spec.metavar}`"
        if spec.type is ValueType.BOOL:
            flag += f" / `--no-{spec.flag[2:]}`"
        cells = (
            f"`{spec.key}`",
            f"`{spec.env}`<br>{flag}",
            _type_text(spec),
            _default_text(spec),
            "yes" if spec.doc.live else "no",
            spec.doc.help.replace("<", "&lt;").replace(">", "&gt;"),
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def configuration_markdown() -> str:
    """Return docs/configuration.md: every setting, grouped as the example config is.

    ``python -m proxy.settings --markdown`` prints it; a test checks
    that the committed file is this text.
    """
    sections: dict[str, list[SettingSpec]] = {}
    for spec in TOP_SPECS.values():
        sections.setdefault(spec.doc.section or "Other", []).append(spec)
    sections["Engine (`[engine]`)"] = list(ENGINE_SPECS.values())
    out = [_MARKDOWN_HEADER]
    out.append("Sections: " + " · ".join(f"[{title}](#{_anchor(title)})" for title in sections))
    for title, specs in sections.items():
        out.extend(("", f"## {title}", ""))
        out.extend(_markdown_table(specs))
    return "\n".join(out) + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.strip().replace(" ", "-")
