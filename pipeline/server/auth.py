"""API keys of the Generation service: who may call it, and each key's engine tenant and
rate limits (pure logic: no grpc, no asyncio).

Keys come from ``--api-key KEY`` (repeatable) and ``--api-key-file PATH``: one key per line,
optionally followed by its limits, ``KEY REQUESTS_PER_SECOND TOKENS_PER_SECOND`` (``-``
leaves one unlimited), and optionally last a LoRA adapter the key is bound to, ``lora=NAME``
(its tenant's requests always run with that adapter: docs/lora.md, "An API key bound to an
adapter"); blank lines and lines starting with ``#`` are skipped. A key without limits gets
the server's default per-key limits. Calls carry ``authorization: Bearer KEY``.

NOTE: a key is never kept, logged or put in an error message in clear text. Only its SHA-256
digest is kept, and its tenant name (``key-`` plus 12 hex digits of the digest) is what the
engine, its logs and its rate-limit messages see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from stages.errors import RequestError

__all__ = [
    "AUTHORIZATION_KEY",
    "ApiKey",
    "ApiKeys",
    "AuthenticationError",
    "PermissionDeniedError",
    "parse_api_key_file",
]

#: the call metadata key that carries ``Bearer KEY`` (gRPC metadata keys are lower case)
AUTHORIZATION_KEY = "authorization"
_BEARER = "bearer"
#: hex digits of the key's digest in its tenant name
_TENANT_DIGITS = 12
_UNLIMITED = "-"
_COMMENT = "#"
#: the key file field that binds a key to a LoRA adapter, ``lora=NAME``
_LORA_FIELD = "lora="
#: a key line: the key alone, or the key and both limits
_FIELDS_WITHOUT_LIMITS = 1
_FIELDS_WITH_LIMITS = 3


class AuthenticationError(RequestError):
    """The call carried no API key, a malformed one, or one the server does not know."""

    kind = "unauthenticated"


class PermissionDeniedError(RequestError):
    """The call's API key may not do this: a key bound to a LoRA adapter naming another
    model, or changing the server's adapters (HTTP 403, gRPC PERMISSION_DENIED)."""

    kind = "permission_denied"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError("an API key must be a non-empty string")
    # NOTE: gRPC metadata values are printable ASCII; whitespace would split a key file line.
    if not all("!" <= char <= "~" for char in key):
        raise ValueError("an API key must be printable ASCII without spaces")
    return key


def _check_limit(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key, by digest. ``limits``: (requests/s, tokens/s) for this key, either
    None for unlimited; ``limits=None`` means the server's default per-key limits. ``lora``:
    the LoRA adapter (served name) the key is bound to (None: none).
    Build one with :meth:`create`."""

    tenant: str
    digest: bytes = dataclasses.field(repr=False)
    limits: tuple[float | None, float | None] | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if len(self.digest) != hashlib.sha256().digest_size:
            raise ValueError("digest must be a SHA-256 digest")
        if self.lora is not None and (
            not isinstance(self.lora, str) or not self.lora or not self.lora.isprintable()
        ):
            raise ValueError(f"a key's LoRA adapter must be a non-empty name, got {self.lora!r}")
        if self.limits is not None:
            requests, tokens = self.limits
            _check_limit("requests_per_second", requests)
            _check_limit("tokens_per_second", tokens)

    @classmethod
    def create(
        cls,
        key: str,
        limits: tuple[float | None, float | None] | None = None,
        lora: str | None = None,
    ) -> ApiKey:
        """The entry for ``key`` (bound to the adapter ``lora``, if given).

        Raises:
            ValueError: an empty key, one with spaces or non-ASCII characters, a limit
                that is not a number > 0, or an empty adapter name (the message never
                contains the key).
        """
        digest = _digest(_check_key(key))
        return cls(f"key-{digest.hex()[:_TENANT_DIGITS]}", digest, limits, lora)


def _parse_limit(text: str, name: str) -> float | None:
    if text == _UNLIMITED:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number or '{_UNLIMITED}', got {text!r}") from None
    return _check_limit(name, value)


def parse_api_key_file(text: str, source: str = "<api keys>") -> list[ApiKey]:
    """Parse an API key file (see the module docstring).

    Raises:
        ValueError: ``source:LINE: problem`` for a malformed line (never showing the key).
    """
    keys = []
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split()
        if not fields or fields[0].startswith(_COMMENT):
            continue
        try:
            lora = None
            if len(fields) > 1 and fields[-1].startswith(_LORA_FIELD):
                lora = fields.pop().removeprefix(_LORA_FIELD)
                if not lora:
                    raise ValueError(f"'{_LORA_FIELD}' names no LoRA adapter")
            if len(fields) == _FIELDS_WITHOUT_LIMITS:
                keys.append(ApiKey.create(fields[0], lora=lora))
            elif len(fields) == _FIELDS_WITH_LIMITS:
                limits = (
                    _parse_limit(fields[1], "requests_per_second"),
                    _parse_limit(fields[2], "tokens_per_second"),
                )
                keys.append(ApiKey.create(fields[0], limits, lora))
            else:
                raise ValueError(
                    f"expected 'KEY' or 'KEY REQUESTS_PER_SECOND TOKENS_PER_SECOND', then "
                    f"optionally '{_LORA_FIELD}NAME', got {len(fields)} fields"
                )
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: {exc}") from None
    return keys


class ApiKeys:
    """The keys a server accepts. With none, authentication is off and every call runs as
    the default tenant ``""``.

    Raises (from the constructor): ValueError when the same key is given twice.
    """

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self._keys: list[ApiKey] = []
        tenants: set[str] = set()
        for key in keys:
            if key.tenant in tenants:
                raise ValueError(f"API key {key.tenant} is given more than once")
            tenants.add(key.tenant)
            self._keys.append(key)

    @classmethod
    def load(cls, keys: Sequence[str] = (), files: Sequence[str | Path] = ()) -> ApiKeys:
        """Keys given literally (``--api-key``) and in key files (``--api-key-file``).

        Raises:
            ValueError: a malformed key or key file line, a key given twice, or a key file
                holding no key (only comments and blank lines).
            OSError: a key file cannot be read.
        """
        entries = [ApiKey.create(key) for key in keys]
        for path in files:
            from_file = parse_api_key_file(Path(path).read_text(), str(path))
            # NOTE: a key file was given to turn authentication on; one with no key in it
            # (keys not mounted yet, say) must not silently leave the server open to all.
            if not from_file:
                raise ValueError(f"{path}: no API key in the file (only comments or blank lines)")
            entries.extend(from_file)
        return cls(entries)

    @property
    def enabled(self) -> bool:
        """Whether calls must carry a key."""
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_limits(self) -> dict[str, tuple[float | None, float | None]]:
        """Engine tenant → (requests/s, tokens/s) for the keys with their own limits (for
        :class:`~pipeline.engine.options.EngineOptions` ``tenant_limits``)."""
        return {key.tenant: key.limits for key in self._keys if key.limits is not None}

    def tenant_adapters(self) -> dict[str, str]:
        """Engine tenant → the LoRA adapter its key is bound to, for the bound keys."""
        return {key.tenant: key.lora for key in self._keys if key.lora is not None}

    def authenticate(self, authorization: str | None) -> str:
        """The engine tenant of the call whose ``authorization`` metadata value is given.

        Returns:
            The key's tenant name; ``""`` when authentication is off.
        Raises:
            AuthenticationError: no value, not ``Bearer KEY``, or an unknown key.
        """
        if not self._keys:
            return ""
        if not authorization:
            raise AuthenticationError(
                f"missing API key: send '{AUTHORIZATION_KEY}: Bearer <key>' metadata"
            )
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != _BEARER or not key.strip():
            raise AuthenticationError("malformed authorization metadata: expected 'Bearer <key>'")
        digest = _digest(key.strip())
        found: ApiKey | None = None
        # NOTE: compare against every key in constant time, so timing reveals nothing.
        for entry in self._keys:
            if hmac.compare_digest(entry.digest, digest):
                found = entry
        if found is None:
            raise AuthenticationError("invalid API key")
        return found.tenant
