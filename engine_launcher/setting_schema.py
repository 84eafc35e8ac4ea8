"""The declaration helper and what is derived from one declaration: type, names.

A setting is one dataclass field made with :func:`setting` (its default and a
:class:`SettingDoc`); this module turns the field into a :class:`SettingSpec`
(key, :class:`ValueType` from the annotation, the choices of a ``Literal`` or of
the declaration, env var, flag), which everything after the declaration reads.
The declarations are in ``proxy.settings.proxy_settings`` and
``engine_launcher.engine_config``.
docs/design.md, Settings.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

__all__ = [
    "BYTES",
    "CONFIG_PATH_ENV",
    "ENV_PREFIX",
    "KIB",
    "MIB",
    "SECONDS",
    "SETTING_METADATA",
    "TESTS_ENV_PREFIX",
    "SettingDoc",
    "SettingSpec",
    "ValueType",
    "env_name",
    "flag_name",
    "setting",
    "specs_of",
    "type_of",
]

BYTES: Final = 1
KIB: Final = 1024 * BYTES
MIB: Final = 1024 * KIB
SECONDS: Final = 1.0

ENV_PREFIX: Final = "OMNI_SIDECAR_"
TESTS_ENV_PREFIX: Final = "OMNI_SIDECAR_TESTS_"
CONFIG_PATH_ENV: Final = "OMNI_SIDECAR_CONFIG"
"""Env var the CLI may read for the config file path; the loader ignores it."""

#: Key of :class:`SettingDoc` in a dataclass field's ``metadata``.
SETTING_METADATA: Final = "omni_sidecar_setting"

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingDoc:
    """Everything about one setting except its name, type and default.

    The name, the Python type and the default come from the dataclass field
    that carries this object in its metadata (see :func:`setting`), so a
    setting is declared in exactly one place.

    Attributes:
        help: What the setting means, for ``--help`` and the example config.
            The first sentence is the short form shown in ``--help``.
        unit: ``"seconds"``, ``"bytes"``, ``"count"``, ``"ratio"`` or ``""``.
        minimum: Smallest allowed number (inclusive), or ``None``.
        maximum: Largest allowed number (inclusive), or ``None``.
        positive: The number must be > 0.
        live: A SIGHUP reload applies a new value at once (to new sessions
            and handshakes); ``False`` means a restart is needed.
        section: Heading under which the example config lists the setting.
        example: TOML text of a typical value, shown commented out in the
            example config when the default is unset or empty.
        metavar: The flag's value placeholder; derived from the unit when empty.
        argv: A list given as text is split like a shell command line
            (``shlex``) instead of at commas.
        check: Further validation of the parsed value; raises ``ValueError``
            with a message that does not repeat the key.
        mask: Returns the value with its secret parts replaced by ``***``, for
            ``--print-config``; ``None`` when the value holds no secret.
        choices: The values a ``str`` setting accepts, where they are data
            (``engine.version``: the releases of a table) and so cannot be a
            ``Literal``; empty: any string (or the ``Literal``'s).
    """

    help: str
    unit: str = ""
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False
    live: bool = False
    section: str = ""
    example: str | None = None
    metavar: str = ""
    argv: bool = False
    check: Callable[[Any], None] | None = None
    mask: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] = ()


def setting(default: _T, **doc: Any) -> _T:
    """Declare a settings field: its default and its :class:`SettingDoc`.

    Use as ``max_sessions: int = setting(64, help="...", unit="count")``.

    Args:
        default: The default value (immutable: tuples, not lists).
        **doc: The :class:`SettingDoc` fields.

    Returns:
        A dataclass ``field`` (typed as the default, for the type checker).
    """
    result: _T = field(default=default, metadata={SETTING_METADATA: SettingDoc(**doc)})
    return result


class ValueType(enum.Enum):
    """How a setting's text is parsed and which TOML type it takes; the value names it."""

    BOOL = "boolean"
    INT = "integer"
    OPT_INT = "integer or nothing"
    FLOAT = "number"
    STR = "string"
    OPT_STR = "string or nothing"
    STR_LIST = "list of strings"
    ARGV = "argument list"
    ENV = "table of strings"


_UNIT_METAVARS: Final = {"seconds": "SECONDS", "bytes": "BYTES", "count": "N", "ratio": "RATIO"}


def env_name(key: str) -> str:
    """Return the env var for a key: ``engine.port`` → ``OMNI_SIDECAR_ENGINE_PORT``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def flag_name(key: str) -> str:
    """Return the flag for a key: ``engine.deploy_config`` → ``--engine-deploy-config``."""
    return "--" + key.replace(".", "-").replace("_", "-")


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One setting as derived from its declaration (see :func:`specs_of`).

    Attributes:
        key: ``max_sessions``; engine fields as ``engine.<field>``.
        name: The dataclass field's name (the key without ``engine.``).
        type: How text is parsed and which TOML type is expected.
        default: The declared default.
        doc: The declaration's :class:`SettingDoc`.
        choices: Allowed values (a ``Literal`` type's, or :attr:`SettingDoc.choices`),
            else empty.
    """

    key: str
    name: str
    type: ValueType
    default: object
    doc: SettingDoc
    choices: tuple[str, ...]

    @property
    def env(self) -> str:
        return env_name(self.key)

    @property
    def flag(self) -> str:
        return flag_name(self.key)

    @property
    def metavar(self) -> str:
        return self.doc.metavar or _UNIT_METAVARS.get(self.doc.unit, "VALUE")


def type_of(hint: object, doc: SettingDoc) -> tuple[ValueType, tuple[str, ...]]:
    """Map a field's annotation to the loader's value type (and its choices)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if doc.choices:
        if hint is not str:
            raise TypeError(f"declared choices need a str setting, not {hint!r}")
        return ValueType.STR, doc.choices
    if origin is Literal:
        return ValueType.STR, tuple(str(a) for a in args)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if inner == [int]:
            return ValueType.OPT_INT, ()
        if inner == [str]:
            return ValueType.OPT_STR, ()
    if origin is tuple:
        if args == (str, Ellipsis):
            return (ValueType.ARGV if doc.argv else ValueType.STR_LIST), ()
        if args and typing.get_origin(args[0]) is tuple:
            return ValueType.ENV, ()
    simple = {bool: ValueType.BOOL, int: ValueType.INT, float: ValueType.FLOAT, str: ValueType.STR}
    if isinstance(hint, type) and hint in simple:
        return simple[hint], ()
    raise TypeError(f"no loader for a setting of type {hint!r}")  # pragma: no cover


def specs_of(cls: type, prefix: str) -> dict[str, SettingSpec]:
    """The specs of a dataclass's :func:`setting` fields, keyed ``prefix + name``, in order."""
    hints = typing.get_type_hints(cls)
    specs: dict[str, SettingSpec] = {}
    for f in dataclasses.fields(cls):
        doc = f.metadata.get(SETTING_METADATA)
        if doc is None:
            continue
        kind, choices = type_of(hints[f.name], doc)
        key = prefix + f.name
        specs[key] = SettingSpec(key, f.name, kind, f.default, doc, choices)
    return specs
