"""``actorline serve`` flags end to end, through the real command and the Python client: TLS
(``--tls-cert``/``--tls-key``) and mutual TLS (``--tls-client-ca``) on both front ends (the
HTTP one driven with the ``openai`` client), and per-key rate limits
from ``--api-key-file`` and the default ``--requests-per-second``/``--tokens-per-second``
(RESOURCE_EXHAUSTED, :class:`RateLimitedError` in the client) that leave other keys alone."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pipeline.server.client import AsyncClient, Client, ServiceUnavailableError, StreamedOutput
from stages.errors import RateLimitedError
from stages.params import SamplingParams
from tests.pipeline.server.serving import Certificate, ServeProcess, serve_arguments

pytestmark = pytest.mark.slow

EXIT_TIMEOUT = 60.0
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
#: a prompt of exactly five tokens (token ids are not re-tokenized)
PROMPT = [504, 2365, 6354, 13, 9]
#: the default per-key limits of the shared server: two requests at once, 16 tokens at once
DEFAULT_REQUESTS_PER_SECOND = 2
DEFAULT_TOKENS_PER_SECOND = 16
#: costs the whole default token burst (five prompt tokens plus max_tokens)
WHOLE_BURST = SamplingParams(
    max_tokens=DEFAULT_TOKENS_PER_SECOND - len(PROMPT), temperature=0.0, ignore_eos=True
)
#: a request costing little: two tokens
CHEAP = SamplingParams(max_tokens=1, temperature=0.0)

#: --api-key: no limits of its own, so the default ones
CLI_KEY = "cli-default-key"
#: key file entries: its own limits (one request, then none for 1000 s), no limits at all
#: ('-'), and the default limits (a key alone on its line)
FILE_REQUEST_LIMITED_KEY = "file-one-request"
FILE_UNLIMITED_KEY = "file-unlimited"
FILE_DEFAULT_KEY = "file-defaults"
KEY_FILE = f"""# key  requests/s  tokens/s
{FILE_REQUEST_LIMITED_KEY} 0.001 -
{FILE_UNLIMITED_KEY} - -
{FILE_DEFAULT_KEY}
"""


def stop(serve: ServeProcess) -> None:
    """SIGTERM the command; it must exit 0."""
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(EXIT_TIMEOUT) == 0, serve.stderr[-3000:]


@pytest.fixture(scope="module")
def tls_serve(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, server_certificate: Certificate
) -> Iterator[ServeProcess]:
    """``actorline serve`` over TLS, with API keys from a flag and a file, and default limits."""
    directory = tmp_path_factory.mktemp("serve-cli")
    key_file = directory / "keys.txt"
    key_file.write_text(KEY_FILE)
    serve = ServeProcess(
        serve_arguments(
            tiny_model_dir,
            "--http-port", "0",
            "--tls-cert", str(server_certificate.certificate_path),
            "--tls-key", str(server_certificate.key_path),
            "--api-key", CLI_KEY,
            "--api-key-file", str(key_file),
            "--requests-per-second", str(DEFAULT_REQUESTS_PER_SECOND),
            "--tokens-per-second", str(DEFAULT_TOKENS_PER_SECOND),
        ),
        directory / "stderr.txt",
    )  # fmt: skip
    try:
        yield serve
        stop(serve)
    finally:
        serve.kill()


def tls_client(serve: ServeProcess, certificate: Certificate, key: str) -> Client:
    return Client(serve.address, api_key=key, tls=certificate.certificate, timeout=60)


# -- TLS ------------------------------------------------------------------------------------


def test_tls_flags_serve_over_tls(
    tls_serve: ServeProcess, server_certificate: Certificate, client_certificate: Certificate
) -> None:
    with tls_client(tls_serve, server_certificate, FILE_UNLIMITED_KEY) as client:
        assert client.health() == "SERVING"
        outputs = list(client.generate("Hello", GREEDY))
        # how many messages the five tokens arrive in depends on timing (a slow reader gets
        # them coalesced); that they all arrive over TLS, and finish, does not
        assert outputs and "".join(o.delta for o in outputs)
        assert outputs[-1].finish_reason == "length"
        assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 5
    # plaintext to the TLS port, and TLS without trusting the server's certificate, fail
    with Client(tls_serve.address, api_key=FILE_UNLIMITED_KEY, timeout=60) as plaintext:
        with pytest.raises(ServiceUnavailableError):
            plaintext.model_info()
        with pytest.raises(ServiceUnavailableError):
            list(plaintext.generate("Hello", GREEDY))
    with (
        tls_client(tls_serve, client_certificate, FILE_UNLIMITED_KEY) as untrusting,
        pytest.raises(ServiceUnavailableError),
    ):
        untrusting.model_info()


def test_tls_client_ca_flag_requires_a_client_certificate(
    tiny_model_dir: Path,
    tmp_path: Path,
    server_certificate: Certificate,
    client_certificate: Certificate,
) -> None:
    serve = ServeProcess(
        serve_arguments(
            tiny_model_dir,
            "--http-port", "0",
            "--tls-cert", str(server_certificate.certificate_path),
            "--tls-key", str(server_certificate.key_path),
            "--tls-client-ca", str(client_certificate.certificate_path),
        ),
        tmp_path / "stderr.txt",
    )  # fmt: skip
    try:
        with Client(
            serve.address,
            tls=server_certificate.certificate,
            client_certificate=(client_certificate.certificate, client_certificate.key),
            timeout=60,
        ) as client:
            assert client.health() == "SERVING"
            outputs = list(client.generate("Hello", GREEDY))
            assert outputs[-1].finish_reason == "length"
        with Client(serve.address, tls=server_certificate.certificate, timeout=60) as anonymous:
            with pytest.raises(ServiceUnavailableError):
                anonymous.model_info()
            with pytest.raises(ServiceUnavailableError):
                list(anonymous.generate("Hello", GREEDY))
        # a certificate the CA did not sign is refused too
        with (
            Client(
                serve.address,
                tls=server_certificate.certificate,
                client_certificate=(server_certificate.certificate, server_certificate.key),
                timeout=60,
            ) as stranger,
            pytest.raises(ServiceUnavailableError),
        ):
            stranger.model_info()
        # the HTTP port asks for a client certificate too
        assert serve.http_url is not None
        mutual = ssl.create_default_context(cafile=server_certificate.certificate_path)
        mutual.load_cert_chain(client_certificate.certificate_path, client_certificate.key_path)
        with urllib.request.urlopen(serve.http_url + "/models", context=mutual) as models:
            assert json.loads(models.read())["data"][0]["object"] == "model"
        anonymous_tls = ssl.create_default_context(cafile=server_certificate.certificate_path)
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(serve.http_url + "/models", context=anonymous_tls).read()
        stop(serve)
    finally:
        serve.kill()


def test_tls_flags_serve_the_http_api_over_tls(
    tls_serve: ServeProcess, server_certificate: Certificate, client_certificate: Certificate
) -> None:
    """The openai client over https, trusting the server's certificate, with a key from the
    key file; plaintext to the same port, and TLS trusting another CA, fail."""
    assert tls_serve.http_url is not None and tls_serve.http_url.startswith("https://")
    trusting = ssl.create_default_context(cafile=server_certificate.certificate_path)
    with (
        openai.DefaultHttpx2Client(verify=trusting) as http_client,
        openai.OpenAI(
            base_url=tls_serve.http_url, api_key=FILE_UNLIMITED_KEY, http_client=http_client,
            max_retries=0,
        ) as client,
    ):  # fmt: skip
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=5, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert completion.usage is not None and completion.usage.completion_tokens == 5
    plaintext = tls_serve.http_url.replace("https://", "http://") + "/models"
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(plaintext, timeout=60).read()
    untrusting = ssl.create_default_context(cafile=client_certificate.certificate_path)
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(tls_serve.http_url + "/models", context=untrusting, timeout=60)
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)


# -- rate limits ----------------------------------------------------------------------------


async def _generate(client: AsyncClient, params: SamplingParams) -> list[StreamedOutput]:
    return [output async for output in client.generate(PROMPT, params)]


def at_once(
    serve: ServeProcess, certificate: Certificate, key: str, params: SamplingParams, count: int
) -> list[list[StreamedOutput] | BaseException]:
    """Send ``count`` requests at the same time with ``key``: each one's outputs or error."""

    async def body() -> list[list[StreamedOutput] | BaseException]:
        async with AsyncClient(
            serve.address, api_key=key, tls=certificate.certificate, timeout=60
        ) as client:
            return await asyncio.gather(
                *(_generate(client, params) for _ in range(count)), return_exceptions=True
            )

    return asyncio.run(body())


def rate_limited(results: list[list[StreamedOutput] | BaseException]) -> list[BaseException]:
    """The errors of ``results``; every other result is a finished stream."""
    errors = [result for result in results if isinstance(result, BaseException)]
    for result in results:
        if not isinstance(result, BaseException):
            assert result[-1].finish_reason == "length"
    assert all(isinstance(error, RateLimitedError) for error in errors), errors
    return errors


def test_a_key_file_limit_is_resource_exhausted_for_that_key_only(
    tls_serve: ServeProcess, server_certificate: Certificate
) -> None:
    with tls_client(tls_serve, server_certificate, FILE_REQUEST_LIMITED_KEY) as client:
        assert list(client.generate(PROMPT, CHEAP))[-1].finished  # its one request
        with pytest.raises(RateLimitedError, match="requests per second"):
            list(client.generate(PROMPT, CHEAP))
    # the unlimited key of the same file is not affected, even far over the default limits
    results = at_once(tls_serve, server_certificate, FILE_UNLIMITED_KEY, WHOLE_BURST, 4)
    assert not rate_limited(results)


def test_default_requests_per_second_applies_to_keys_without_limits(
    tls_serve: ServeProcess, server_certificate: Certificate
) -> None:
    # two requests at once are the burst of 2/s (the flags give no longer burst): of four
    # cheap ones sent at once, the two over the burst are refused unless they arrive after
    # the bucket refilled, which takes 0.5 s for one and 1 s for both; so one at least is
    # refused unless the four arrivals span a whole second
    results = at_once(tls_serve, server_certificate, CLI_KEY, CHEAP, 4)
    errors = rate_limited(results)
    assert 1 <= len(errors) <= 2, results
    assert all("requests per second" in str(error) for error in errors)
    results = at_once(tls_serve, server_certificate, FILE_UNLIMITED_KEY, CHEAP, 4)
    assert not rate_limited(results)


def test_default_tokens_per_second_applies_to_keys_without_limits(
    tls_serve: ServeProcess, server_certificate: Certificate
) -> None:
    # each request takes the whole 16-token burst, which takes 1 s to refill (the flags give
    # no longer burst): of two at once, one is refused
    results = at_once(tls_serve, server_certificate, FILE_DEFAULT_KEY, WHOLE_BURST, 2)
    (error,) = rate_limited(results)
    assert "tokens per second" in str(error)
    results = at_once(tls_serve, server_certificate, FILE_UNLIMITED_KEY, WHOLE_BURST, 2)
    assert not rate_limited(results)
