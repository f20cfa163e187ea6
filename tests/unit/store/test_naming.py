from __future__ import annotations

import pytest

from kvsidecar.errors import BadRequest, InvalidSessionId
from kvsidecar.store.naming import (
    HOOK_SCOPE,
    SNAPSHOT_FILE,
    SnapshotIdentity,
    other_generation,
    parse_snapshot_name,
    short_id,
    snapshot_filename,
    validate_label,
    validate_session_id,
)


def test_the_operators_keys_are_those_of_before_scopes_and_every_other_scope_has_its_own() -> None:
    """The hook API's snapshots survive the upgrade that made the credential scope part of a session's
    identity: their keys are unchanged (pinned here); one session id under two credentials is two keys."""
    hook = ident()
    assert hook.scope == HOOK_SCOPE
    assert hook.key == "36b4291289adbab9d0a3262ffa64b031"  # the key it had before scopes
    keys = {hook.key, ident(scope="kalice").key, ident(scope="kbob").key, ident(scope="anon").key}
    assert len(keys) == 4
    for bad in ("", "K", "k-x", "../x", "hook\n", "a" * 65, "k\x00"):
        with pytest.raises(BadRequest):
            ident(scope=bad)


def ident(**kw: str) -> SnapshotIdentity:
    base = {"server": "local", "provider": "p", "model": "m", "session_id": "s1"}
    return SnapshotIdentity(**(base | kw))


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../../etc/passwd",
        "a/b",
        "a\\b",
        "nul\x00byte",
        "x" * 129,
        "sp ace",
        "\uff53\uff45\uff53\uff53\uff49\uff4f\uff4e",  # fullwidth look-alike
        "\u00e9",
        "\u0430dmin",  # Cyrillic a
        "a\nb",
        "trailing-newline\n",  # `$` used to accept it
        "C:\\x",
    ],
)
def test_hostile_session_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidSessionId):
        validate_session_id(bad)


@pytest.mark.parametrize("good", ["a", "01991d-7c85", "user@host:session.1+x", "x" * 128, "A_B-c.d"])
def test_ordinary_session_ids_pass(good: str) -> None:
    assert validate_session_id(good) == good


@pytest.mark.parametrize("bad", ["", "x" * 257, "tab\there", "nl\n"])
def test_labels_are_bounded_and_printable(bad: str) -> None:
    with pytest.raises(BadRequest):
        validate_label("model", bad)


def test_filenames_are_flat_opaque_and_generation_suffixed() -> None:
    i = ident(session_id="../../etc/passwd".replace("/", "_"), model="Qwen/../evil")
    for gen in ("a", "b"):
        name = i.filename(gen)
        assert SNAPSHOT_FILE.match(name)
        assert "/" not in name and ".." not in name
        assert "passwd" not in name and "evil" not in name


def test_every_identity_part_changes_the_name() -> None:
    base = ident()
    names = {base.key}
    for field, value in [("server", "other"), ("provider", "q"), ("model", "m2"), ("session_id", "s2")]:
        names.add(ident(**{field: value}).key)
    assert len(names) == 5


def test_digest_separates_fields_unambiguously() -> None:
    assert ident(provider="ab", model="c").key != ident(provider="a", model="bc").key


def test_names_are_stable() -> None:
    # A change here orphans every snapshot on disk: it must be deliberate (bump _NAME_VERSION).
    assert ident().key == ident().key
    assert len(ident().key) == 32
    assert short_id("s1") == short_id("s1") and len(short_id("s1")) == 8 and "s1" not in short_id("s1")


def test_other_generation() -> None:
    assert other_generation(None) == "a"
    assert other_generation("a") == "b"
    assert other_generation("b") == "a"


@pytest.mark.parametrize(
    "name",
    [
        "0" * 32 + ".a.bin\n",  # `$` used to accept a trailing newline
        "0" * 32 + ".a.bin\x00",
        "0" * 31 + "\uff10.a.bin",  # fullwidth zero
        "0" * 31 + "\u0660.a.bin",  # Arabic-Indic zero
        "A" * 32 + ".a.bin",
        "0" * 32 + ".c.bin",
        "0" * 33 + ".a.bin",
        "../" + "0" * 32 + ".a.bin",
        "0" * 32 + ".a.bin/..",
        "",
    ],
)
def test_only_our_exact_names_parse(name: str) -> None:
    assert parse_snapshot_name(name) is None
    assert not SNAPSHOT_FILE.match(name)


def test_generated_names_parse_back_to_their_key() -> None:
    i = ident()
    assert parse_snapshot_name(i.filename("b")) == (i.key, "b")
    assert snapshot_filename(i.key, "a") == i.filename("a")
    with pytest.raises(ValueError):
        snapshot_filename("../x", "a")
