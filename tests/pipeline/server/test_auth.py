"""API keys: key files, tenants and limits, and authenticating the authorization metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.server.auth import ApiKey, ApiKeys, AuthenticationError, parse_api_key_file


def test_key_file_lines_give_keys_with_or_without_limits() -> None:
    text = "# comment\n\nalpha\n  beta 2.5 100  \ngamma - 50\n#delta\n"
    alpha, beta, gamma = parse_api_key_file(text, "keys.txt")
    assert alpha.limits is None
    assert beta.limits == (2.5, 100.0)
    assert gamma.limits == (None, 50.0)
    keys = ApiKeys([alpha, beta, gamma])
    assert len(keys) == 3 and keys.enabled
    assert keys.tenant_limits() == {beta.tenant: (2.5, 100.0), gamma.tenant: (None, 50.0)}


def test_key_file_lines_may_bind_a_key_to_a_lora_adapter() -> None:
    plain, bound, limited = parse_api_key_file("plain\nbound lora=sql\nlimited 2 - lora=chat\n")
    assert (plain.lora, bound.lora, limited.lora) == (None, "sql", "chat")
    assert bound.limits is None and limited.limits == (2.0, None)
    keys = ApiKeys([plain, bound, limited])
    assert keys.tenant_adapters() == {bound.tenant: "sql", limited.tenant: "chat"}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("s3cret 1", "got 2 fields"),
        ("s3cret 1 2 3", "got 4 fields"),
        ("s3cret fast 10", "requests_per_second must be a number"),
        ("s3cret 1 0", "tokens_per_second must be a finite number > 0"),
        ("s3cret -1 5", "requests_per_second must be a finite number > 0"),
        ("s3cret inf 5", "requests_per_second must be a finite number > 0"),
        ("sécret", "printable ASCII"),
        ("s3cret lora=", "names no LoRA adapter"),
        ("s3cret 1 lora=a", "got 2 fields"),
    ],
)
def test_bad_key_file_lines_name_the_line_but_not_the_key(line: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_api_key_file(f"ok-key\n{line}\n", "keys.txt")
    message = str(caught.value)
    assert message.startswith("keys.txt:2: ") and problem in message
    assert "s3cret" not in message and "sécret" not in message


def test_load_combines_literal_keys_and_files(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("from-file 1 -\n")
    keys = ApiKeys.load(["literal"], [path])
    assert keys.authenticate("Bearer literal") != keys.authenticate("Bearer from-file")
    with pytest.raises(ValueError, match="more than once"):
        ApiKeys.load(["literal"], [path, path])
    with pytest.raises(OSError):
        ApiKeys.load([], [tmp_path / "missing"])


def test_a_key_file_without_keys_is_an_error_naming_it(tmp_path: Path) -> None:
    """A file given to turn authentication on must not silently leave it off."""
    empty = tmp_path / "keys.txt"
    empty.write_text("# keys are mounted here\n\n  \n")
    assert parse_api_key_file(empty.read_text()) == []  # the parser alone has no opinion
    with pytest.raises(ValueError, match="no API key in the file") as caught:
        ApiKeys.load(["literal"], [empty])
    assert str(caught.value).startswith(f"{empty}: ")
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeys.load([""])


def test_authenticate_returns_the_keys_tenant() -> None:
    keys = ApiKeys([ApiKey.create("alpha"), ApiKey.create("beta")])
    alpha = keys.authenticate("Bearer alpha")
    assert alpha == ApiKey.create("alpha").tenant
    assert alpha.startswith("key-") and "alpha" not in alpha
    assert keys.authenticate("bearer  beta ") == ApiKey.create("beta").tenant
    assert alpha != keys.authenticate("Bearer beta")


@pytest.mark.parametrize(
    ("authorization", "problem"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("alpha", "malformed"),
        ("Basic alpha", "malformed"),
        ("Bearer ", "malformed"),
        ("Bearer alphax", "invalid API key"),
    ],
)
def test_authenticate_refuses_bad_metadata(authorization: str | None, problem: str) -> None:
    keys = ApiKeys([ApiKey.create("alpha")])
    with pytest.raises(AuthenticationError, match=problem) as caught:
        keys.authenticate(authorization)
    assert "alphax" not in str(caught.value)


def test_without_keys_authentication_is_off() -> None:
    keys = ApiKeys()
    assert not keys.enabled
    assert keys.authenticate(None) == "" and keys.authenticate("Bearer anything") == ""


def test_keys_are_not_kept_in_clear() -> None:
    key = ApiKey.create("very-secret", (1.0, None))
    assert "very-secret" not in repr(key) and "very-secret" not in repr(ApiKeys([key]))
    with pytest.raises(ValueError, match="non-empty"):
        ApiKey.create("")
    with pytest.raises(ValueError, match="requests_per_second"):
        ApiKey.create("k", (0.0, None))
