"""The API key file (proxy/edge/auth.py): keys with optional names, and which name a client gets.

docs/design.md, Usage: ``KEY`` or ``KEY name=NAME``; any other field is an
error naming the line, never ignored; the error never contains a key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.core.usage import UNNAMED_KEY
from proxy.edge.auth import KEY_SUBPROTOCOL_PREFIX, AuthPolicy, load_api_keys, load_key_file
from proxy.errors import ConfigError


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_named_and_plain_lines(tmp_path: Path) -> None:
    keys = load_api_keys(
        ["from-settings"],
        _file(
            tmp_path,
            "# team keys\nsk-alpha name=alpha\n\n  sk-plain  # no name\nsk-beta   name=team.b-2_x\n",
        ),
    )
    assert keys == {
        "from-settings": None,
        "sk-alpha": "alpha",
        "sk-plain": None,
        "sk-beta": "team.b-2_x",
    }


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("sk-secret-1 quota=5", "line 2: unknown field 'quota'"),
        ("sk-secret-1 name", "line 2: unknown field 'name'"),
        ("sk-secret-1 nam=x", "line 2: unknown field 'nam'"),
        ("sk-secret-1 name=", "line 2: a name is 1-64"),
        ("sk-secret-1 name=has/slash", "line 2: a name is 1-64"),
        ("sk-secret-1 name=" + "n" * 65, "line 2: a name is 1-64"),
        ("sk-secret-1 name=a name=b", "line 2: name given twice"),
    ],
)
def test_a_bad_line_is_an_error_naming_its_number_and_not_the_key(
    tmp_path: Path, line: str, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_api_keys((), _file(tmp_path, f"sk-good name=good\n{line}\n"))
    assert info.value.key == "api_keys_file"
    assert says in str(info.value)
    assert "sk-secret-1" not in str(info.value) and "sk-good" not in str(info.value)


def test_a_name_of_64_characters_is_fine(tmp_path: Path) -> None:
    assert load_api_keys((), _file(tmp_path, "k name=" + "n" * 64)) == {"k": "n" * 64}


def test_a_file_of_comments_only_still_refuses_to_turn_auth_off(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contains no keys"):
        load_api_keys((), _file(tmp_path, "# nothing\n\n"))


def test_the_accepted_key_gives_its_name_never_the_key() -> None:
    policy = AuthPolicy({"sk-a": "alpha", "sk-b": None}, ())
    bearer = policy.check({"Authorization": "Bearer sk-a"}, [])
    assert bearer.ok and bearer.key_name == "alpha"
    plain = policy.check({}, [f"{KEY_SUBPROTOCOL_PREFIX}sk-b"])
    assert plain.ok and plain.key_name == UNNAMED_KEY
    assert not policy.check({"Authorization": "Bearer sk-c"}, []).ok
    assert policy.key_names == frozenset({"alpha", UNNAMED_KEY})


def test_without_auth_every_session_is_unnamed() -> None:
    result = AuthPolicy((), ()).check({}, [])
    assert result.ok and result.key_name == UNNAMED_KEY


def test_quota_fields_are_read_per_name(tmp_path: Path) -> None:
    from proxy.core.quota_rules import KeyQuota

    keys, quotas = load_key_file(
        (),
        _file(
            tmp_path,
            "sk-a name=alpha max_sessions=3 sessions_per_minute=10 audio_seconds_per_day=3600\n"
            "sk-b name=alpha max_sessions=3 sessions_per_minute=10 audio_seconds_per_day=3600\n"
            "sk-c name=gamma\n",
        ),
    )
    assert keys == {"sk-a": "alpha", "sk-b": "alpha", "sk-c": "gamma"}
    assert quotas == {"alpha": KeyQuota(3, 10, 3600.0)}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sk-a max_sessions=1", "line 1: a quota needs name=NAME"),
        ("sk-a name=a max_sessions=-1", "line 1: max_sessions must be a number >= 0"),
        ("sk-a name=a sessions_per_minute=1.5", "sessions_per_minute must be a number"),
        ("sk-a name=a audio_seconds_per_day=nan", "audio_seconds_per_day must be a number"),
        ("sk-a name=a max_sessions=1 max_sessions=2", "line 1: max_sessions given twice"),
        ("sk-a name=a max_sessions=1\nsk-b name=a max_sessions=2", "line 2: name 'a' already"),
    ],
)
def test_bad_quota_fields_are_errors_naming_the_line(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_key_file((), _file(tmp_path, text + "\n"))
    assert "sk-a" not in str(caught.value)
