"""The table of engine releases (proxy/core/engine_releases.py) and the one copy beside it.

The table is the one place a release is written down: everything else derives
from it (the capabilities, version parsing, what the wire teaches, the OpenAI
dialect's tables, ``engine.version``'s choices, the metric label values,
preflight's simulator default), and no other product module writes a release
(:class:`TestOneHome`). The simulator, another process, keeps its own rows,
checked here; the design document's table is checked by tests/test_docs.py
(docs/design.md, New engine release).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Final

import pytest

from engine_launcher.engine_config import EngineConfig
from engine_launcher.preflight.runner import engine_package_version
from engine_launcher.simulator import releases as simulator_releases
from engine_launcher.simulator.flags import SimulatorConfig, parse_args
from proxy.core.capabilities import (
    CapabilitySource,
    EngineCapabilities,
    EngineVersion,
    parse_version,
)
from proxy.core.engine_releases import (
    CAPABILITIES,
    RELEASES,
    EngineRelease,
    WireSign,
    release_of,
    shown_by,
)

VERSIONS = tuple(r.version.value for r in RELEASES)


def _minor_of(release: EngineRelease) -> tuple[int, int]:
    major, minor = release.version.value.split(".")
    return int(major), int(minor)


class TestTable:
    def test_one_row_per_version_oldest_first(self) -> None:
        assert [r.version for r in RELEASES] == [
            v for v in EngineVersion if v is not EngineVersion.UNKNOWN
        ]
        ages = [_minor_of(r) for r in RELEASES]
        assert ages == sorted(ages) and len(set(ages)) == len(ages)

    def test_every_capability_is_a_named_flag(self) -> None:
        for release in RELEASES:
            for name in CAPABILITIES:
                assert isinstance(getattr(release, name), bool), (release.version, name)

    def test_unknown_behaves_as_the_oldest(self) -> None:
        assert release_of(EngineVersion.UNKNOWN) is RELEASES[0]
        unknown = EngineCapabilities()
        oldest = EngineCapabilities.of(RELEASES[0].version, CapabilitySource.CONFIG)
        assert dataclasses.replace(oldest, version=unknown.version, source=unknown.source) == (
            unknown
        )


class TestDerived:
    @pytest.mark.parametrize("release", RELEASES, ids=VERSIONS)
    def test_capabilities_are_the_rows(self, release: EngineRelease) -> None:
        caps = EngineCapabilities.of(release.version, CapabilitySource.CONFIG)
        for field in dataclasses.fields(EngineCapabilities):
            if field.name in CAPABILITIES:
                assert getattr(caps, field.name) == getattr(release, field.name), field.name

    @pytest.mark.parametrize("release", RELEASES, ids=VERSIONS)
    def test_a_package_version_parses_to_its_release(self, release: EngineRelease) -> None:
        text = release.version.value
        for spelling in (f"{text}.0", f"{text}.0rc1", f"v{text}.2", f"{text}.0.dev3+cu12"):
            assert parse_version(spelling) is release.version, spelling
        major, minor = _minor_of(release)
        newer = parse_version(f"{major}.{minor + 1}.0")
        following = [r.version for r in RELEASES if _minor_of(r) == (major, minor + 1)]
        assert newer is (following[0] if following else release.version), (
            "an unknown release behaves as the newest known one before it"
        )

    def test_older_and_newer_than_all_known(self) -> None:
        major, minor = _minor_of(RELEASES[0])
        assert parse_version(f"{major}.{minor - 1}.9") is RELEASES[0].version
        newest_major, _ = _minor_of(RELEASES[-1])
        assert parse_version(f"{newest_major + 1}.0.0") is RELEASES[-1].version
        assert parse_version("dev") is EngineVersion.UNKNOWN
        assert parse_version(None) is EngineVersion.UNKNOWN

    def test_configured_versions_resolve_to_their_row(self) -> None:
        for release in RELEASES:
            caps = EngineCapabilities.resolve(release.version.value, None)
            assert (caps.version, caps.source) == (release.version, CapabilitySource.CONFIG)


class TestWireSigns:
    @pytest.mark.parametrize("sign", list(WireSign), ids=[s.name for s in WireSign])
    def test_a_sign_teaches_the_oldest_release_with_its_capability(self, sign: WireSign) -> None:
        assert sign.value in CAPABILITIES
        having = [r.version for r in RELEASES if getattr(r, sign.value)]
        assert having, f"no release shows {sign}"
        assert shown_by(sign) is having[0]

    @pytest.mark.parametrize("sign", list(WireSign), ids=[s.name for s in WireSign])
    def test_a_capability_the_wire_proves_is_never_lost(self, sign: WireSign) -> None:
        """The wire only moves the version up: every newer release must show it too."""
        flags = [getattr(r, sign.value) for r in RELEASES]
        assert flags == sorted(flags), f"{sign.value} is lost in a later release"

    def test_the_session_learns_through_the_table(self) -> None:
        for sign in WireSign:
            learned = EngineCapabilities().learn(shown_by(sign))
            assert getattr(learned, sign.value) is True
            assert learned.source is CapabilitySource.WIRE


#: The product modules that may write a release as a literal: the table, and the
#: simulator's own rows (another process, which imports nothing of the proxy).
RELEASE_HOMES: Final = frozenset(
    {"proxy/core/engine_releases.py", "engine_launcher/simulator/releases.py"}
)
#: A string that is a release: "0.32", "v0.32", "0.32.0", "0.32.0rc1", "0.32.0.dev3".
RELEASE_LITERAL: Final = re.compile(r"^v?\d+\.\d+(\.\d+)?(rc\d+|\.dev\d+)?$")
ROOT: Final = Path(__file__).resolve().parents[3]
PRODUCT_FILES: Final = sorted(
    path
    for package in ("proxy", "engine_launcher", "metrics")
    for path in (ROOT / package).rglob("*.py")
    if "__pycache__" not in path.parts
)


def release_literals(path: Path) -> list[str]:
    """``line: 'text'`` of each string constant in the file at ``path`` that is a release."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and RELEASE_LITERAL.match(node.value)
    ]
    found.sort(key=lambda node: (node.lineno, node.col_offset))
    return [f"{node.lineno}: {node.value!r}" for node in found]


class TestOneHome:
    """A release is written in the table alone (and in the simulator's rows)."""

    @pytest.mark.parametrize(
        "path", PRODUCT_FILES, ids=[str(p.relative_to(ROOT)) for p in PRODUCT_FILES]
    )
    def test_no_other_module_writes_a_release(self, path: Path) -> None:
        where = str(path.relative_to(ROOT))
        if where in RELEASE_HOMES:
            return
        found = release_literals(path)
        assert not found, (
            f"{where} writes a release {found}: derive it from "
            "proxy.core.engine_releases.RELEASES (docs/design.md, New engine release)"
        )

    def test_the_homes_are_where_the_releases_are(self) -> None:
        for where in RELEASE_HOMES:
            assert len(release_literals(ROOT / where)) >= len(RELEASES), where

    def test_the_rule_sees_a_release_written_elsewhere(self, tmp_path: Path) -> None:
        # The rule itself, broken on purpose: a copy of the choices, a default, prose.
        target = tmp_path / "engine_config.py"
        target.write_text(
            'CHOICES = ("auto", "0.30", "0.31")\n'
            'DEFAULT = "0.33.1rc2"\n'
            '"""0.30 behaves as documented in 0.31."""\n'
            'RATIO = "0.5x"\n',
            encoding="utf-8",
        )
        assert release_literals(target) == ["1: '0.30'", "1: '0.31'", "2: '0.33.1rc2'"]


class TestSimulator:
    """The simulator's own rows (engine_launcher/simulator/releases.py) against the table."""

    def test_the_simulator_plays_every_release(self) -> None:
        assert simulator_releases.ENGINE_VERSIONS == VERSIONS
        for version in VERSIONS:
            assert parse_args(["--engine-version", version]).release.version == version

    @pytest.mark.parametrize("release", RELEASES, ids=VERSIONS)
    def test_the_simulators_rows_agree_with_the_table(self, release: EngineRelease) -> None:
        row = simulator_releases.release_of(release.version.value)
        names = {f.name for f in dataclasses.fields(row)} - {"version"}
        assert names - set(CAPABILITIES) == simulator_releases.SIMULATOR_ONLY, (
            "a simulator capability the table lacks must be named SIMULATOR_ONLY"
        )
        for name in names & set(CAPABILITIES):
            assert getattr(row, name) == getattr(release, name), (release.version, name)

    def test_preflight_knows_the_simulators_default(self) -> None:
        default = SimulatorConfig().engine_version
        assert default == simulator_releases.ENGINE_VERSIONS[0]
        assert engine_package_version(EngineConfig(kind="simulator")) == default
        assert parse_version(default) is RELEASES[0].version
