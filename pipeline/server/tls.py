"""TLS of the servers: :class:`ServerTLS`, the PEM certificate chain and private key that
``actorline serve`` (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``) gives both front ends,
checked when read so that a bad file is a clear error before the model loads.

The gRPC front end takes it as gRPC credentials (:meth:`ServerTLS.credentials`), the HTTP
front end as an :class:`ssl.SSLContext` (:meth:`ServerTLS.ssl_context`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc

__all__ = ["ServerTLS"]

_PEM_MARKER = b"-----BEGIN "
_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
#: PKCS#8 ("PRIVATE KEY"), PKCS#1 ("RSA PRIVATE KEY"), SEC 1 ("EC PRIVATE KEY"), ...
_PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )?PRIVATE KEY-----")
#: PKCS#8 "ENCRYPTED PRIVATE KEY", or the legacy OpenSSL header of an encrypted PKCS#1 key
_PEM_ENCRYPTED = re.compile(rb"-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type: 4,ENCRYPTED")
#: what the HTTP front end speaks over TLS
_ALPN_PROTOCOLS = ["http/1.1"]


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTLS:
    """The server's PEM certificate chain and private key; with ``client_ca``, clients must
    present a certificate signed by it (mutual TLS).

    Raises (from the constructor): ValueError for empty or non-PEM data.
    """

    certificate_chain: bytes = dataclasses.field(repr=False)
    private_key: bytes = dataclasses.field(repr=False)
    client_ca: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("certificate_chain", "private_key", "client_ca"):
            value = getattr(self, name)
            if value is None and name == "client_ca":
                continue
            if not isinstance(value, bytes) or _PEM_MARKER not in value:
                raise ValueError(f"{name} must be PEM data (bytes with '-----BEGIN ...')")

    @classmethod
    def from_files(
        cls,
        certificate_chain: str | Path,
        private_key: str | Path,
        client_ca: str | Path | None = None,
    ) -> ServerTLS:
        """Read the PEM files and check them as the TLS library will use them: the chain
        holds certificates, the key file an unencrypted private key, the key belongs to the
        chain's first certificate, and ``client_ca`` holds certificates. So a bad pair (say
        the two files swapped) is a clear error here, not a failure to listen later.

        Raises:
            OSError: a file cannot be read. ValueError: a file is not what it should be, or
                the key does not match the certificate (the message names the file).
        """
        chain = _read_pem(certificate_chain, "certificate chain")
        key = _read_pem(private_key, "private key")
        ca = _read_pem(client_ca, "client CA") if client_ca is not None else None
        _check_certificates(certificate_chain, chain, "certificate chain")
        _check_private_key(private_key, key)
        _check_key_pair(certificate_chain, private_key)
        if client_ca is not None and ca is not None:
            _check_certificates(client_ca, ca, "client CA")
        return cls(chain, key, ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side :class:`ssl.SSLContext` with this chain and key (TLS 1.2 or newer);
        with ``client_ca``, a client must present a certificate it signed.

        NOTE: Python's ``ssl`` loads a certificate chain and key from files only; they are
        handed to it through an anonymous in-memory file (Linux) or a private temporary
        directory removed at once, never through a file that outlives this call.

        Raises:
            ValueError: the chain or key cannot be loaded.
        """
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(_ALPN_PROTOCOLS)
        with _pem_file(self.certificate_chain) as chain, _pem_file(self.private_key) as key:
            try:
                context.load_cert_chain(chain, key, password=lambda: b"")
            except ssl.SSLError as exc:
                raise ValueError(f"TLS certificate chain and key cannot be loaded: {exc}") from None
        if self.client_ca is not None:
            context.load_verify_locations(cadata=self.client_ca.decode("latin-1"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path from which ``data`` can be read while the context lasts."""
    if hasattr(os, "memfd_create"):
        descriptor = os.memfd_create("actorline-tls", os.MFD_CLOEXEC)
        try:
            with open(descriptor, "wb", closefd=False) as file:
                file.write(data)
            yield f"/proc/self/fd/{descriptor}"
        finally:
            os.close(descriptor)
        return
    with tempfile.TemporaryDirectory(prefix="actorline-tls-") as directory:  # mode 0700
        path = Path(directory) / "pem"
        path.write_bytes(data)
        yield str(path)


def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"TLS {what} {path}: {exc.strerror or exc}") from None


def _check_certificates(path: str | Path, data: bytes, what: str) -> None:
    """``data`` (read from ``path``) holds PEM certificates that the TLS library parses."""
    if _PEM_CERTIFICATE not in data:
        swapped = what == "certificate chain" and _PEM_PRIVATE_KEY.search(data)
        hint = " (it holds a private key: are the certificate and key swapped?)"
        raise ValueError(
            f"TLS {what} {path} holds no PEM certificate ('{_PEM_CERTIFICATE.decode()}')"
            + (hint if swapped else "")
        )
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise ValueError(f"TLS {what} {path} is not a valid PEM certificate: {exc}") from None


def _check_private_key(path: str | Path, data: bytes) -> None:
    """``data`` (read from ``path``) holds an unencrypted PEM private key."""
    if _PEM_ENCRYPTED.search(data):
        raise ValueError(f"TLS private key {path} is encrypted; gRPC needs an unencrypted key")
    if not _PEM_PRIVATE_KEY.search(data):
        hint = " (it holds a certificate: are the certificate and key swapped?)"
        raise ValueError(
            f"TLS private key {path} holds no PEM private key ('-----BEGIN ... PRIVATE KEY')"
            + (hint if _PEM_CERTIFICATE in data else "")
        )


def _check_key_pair(certificate_chain: str | Path, private_key: str | Path) -> None:
    """The key parses and belongs to the chain's first certificate (``ssl`` checks both, as
    the TLS library serving the port will)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # NOTE: the password callback keeps an encrypted key the marker check missed from
        # prompting on the terminal; the empty password then fails to decrypt it.
        context.load_cert_chain(str(certificate_chain), str(private_key), password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"TLS private key {private_key} does not match the certificate {certificate_chain}"
            ) from None
        raise ValueError(f"TLS private key {private_key} cannot be loaded: {exc}") from None
