"""What may enter the HTTP API, checked before a request reaches its handler: the API key
(under ``/v1/``, and vLLM's ``/tokenize`` and ``/detokenize``) and the size of the body.

- **API key.** ``Authorization: Bearer KEY`` is checked with the same
  :class:`~pipeline.server.auth.ApiKeys` as the gRPC front end (a wrong, missing or doubled
  key is 401 ``invalid_api_key``), before any of the body is read. The key's tenant is put
  in the request's scope (:func:`tenant_of`), where the handlers find it: it selects the
  engine tenant, so the key's rate limits apply. ``/health`` and ``/metrics`` need no key
  (probes and scrapers have none), like gRPC health and reflection.
- **Body cap.** A body larger than ``max_request_bytes`` is refused with 413
  ``request_too_large`` before more than the cap is buffered: a ``Content-Length`` over the
  cap is refused before any byte of the body is read (with ``Expect: 100-continue`` the
  client never sends it), and a body of unknown length (chunked) is counted as it streams
  in and refused once past the cap. The refusal closes the connection (the rest of the body
  is never read). uvicorn stops reading a connection whose unread body passes 64 KiB, so
  what is buffered stays near the cap.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.server.auth import AUTHORIZATION_KEY, ApiKeys, AuthenticationError
from pipeline.server.http.errors import ApiError

__all__ = ["PROTECTED_PATHS", "PROTECTED_PREFIX", "Gate", "tenant_of"]

#: paths that need an API key when the server has keys: the API, and vLLM's token endpoints
#: (they spend the server's CPU on a body like any request)
PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})
_TENANT_KEY = "actorline.tenant"
_AUTHORIZATION = AUTHORIZATION_KEY.encode()
_CONTENT_LENGTH = b"content-length"
_CLOSE = {"Connection": "close"}


def tenant_of(scope: Scope) -> str:
    """The engine tenant of an authenticated request (``""`` when the server has no keys)."""
    tenant = scope.get(_TENANT_KEY, "")
    return tenant if isinstance(tenant, str) else ""


class _BodyTooLarge(ApiError):
    def __init__(self, max_bytes: int, size: str) -> None:
        super().__init__(
            413,
            f"the request body is {size} bytes; this server accepts at most {max_bytes} "
            "(actorline serve --max-request-bytes)",
            code="request_too_large",
            headers=_CLOSE,
        )


class Gate:
    """ASGI middleware: authenticate ``/v1/`` requests with ``api_keys`` and cap bodies at
    ``max_request_bytes`` (see the module docstring).

    Raises (from the constructor): ValueError for a cap that is not a positive integer.
    """

    def __init__(self, app: ASGIApp, *, api_keys: ApiKeys, max_request_bytes: int) -> None:
        if type(max_request_bytes) is not int or max_request_bytes < 1:
            raise ValueError(
                f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}"
            )
        self.app = app
        self.api_keys = api_keys
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            path = str(scope.get("path", ""))
            if path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS:
                scope[_TENANT_KEY] = self._authenticate(scope)
            declared = _content_length(scope)
            if declared is not None and declared > self.max_request_bytes:
                raise _BodyTooLarge(self.max_request_bytes, str(declared))
        except ApiError as error:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _authenticate(self, scope: Scope) -> str:
        values = [value for name, value in scope.get("headers", ()) if name == _AUTHORIZATION]
        try:
            if len(values) > 1:
                # NOTE: which one counts would be a guess (a proxy may have checked another)
                raise AuthenticationError(f"{len(values)} Authorization headers; send exactly one")
            header = values[0].decode("latin-1") if values else None
            return self.api_keys.authenticate(header)
        except AuthenticationError as error:
            raise ApiError.from_error(error) from None

    def _limited(self, receive: Receive) -> Receive:
        """``receive``, counting the body's bytes: past the cap, it raises the 413 (a
        handler reading the body answers with it)."""
        received = 0
        cap = self.max_request_bytes

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _BodyTooLarge(cap, f"more than {cap}")
            return message

        return receive_limited


def _content_length(scope: Scope) -> int | None:
    """The declared body size (None: none declared; the HTTP server refuses a malformed
    one itself)."""
    for name, value in scope.get("headers", ()):
        if name == _CONTENT_LENGTH:
            try:
                return int(value)
            except ValueError:
                return None
    return None
