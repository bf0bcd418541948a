"""Connecting this process to a Ray cluster as users start one, token authentication included.

Ray (2.52 and later) authenticates with a token: a cluster started with ``RAY_AUTH_MODE=token``
(or by ``ray start --head`` / ``ray.init()`` when a token exists already: Ray's
``ray/_private/authentication/authentication_token_setup.py``) refuses every caller without
its token. Ray's driver sends one only in token mode, which ``ray.init`` turns on by itself
for a cluster it finds running here (``"auto"``) but never for an address it is given; the
driver then retries for 20 s, logging ``InvalidAuthToken`` once a second, and fails with
"Failed to connect to Ray cluster". :func:`connect_ray` does what Ray's own CLI does for the
address it is given (docs/parallelism.md, "Token authentication"):

- **The token.** ``ray_auth_token_file`` (the option, ``--ray-auth-token-file``) if given;
  else where Ray's token loader looks, in its order: ``RAY_AUTH_TOKEN``, the file
  ``RAY_AUTH_TOKEN_PATH`` names, ``~/.ray/auth_token`` (``ray get-auth-token`` prints it).
- **The mode.** ``RAY_AUTH_MODE`` if set is obeyed, as Ray obeys it. Unset, the cluster is
  asked first without a token, and only when it asks for one is token mode turned on with the
  token found (so a token is never sent to a cluster that does not check it). The mode and a
  token file are set in this process's environment (Ray's C++ core reads them there), so the
  processes it starts later inherit them; the actors run under the cluster's own raylet,
  which was started with the token.
- **A refusal is one line.** Before ``ray.init`` the cluster's GCS is probed (a TCP connect,
  then Ray's GCS client in a fresh interpreter, as ``ray status`` connects:
  ``ray/scripts/scripts.py``), so a wrong address, a missing or wrong token and a Ray or
  Python version the cluster does not run are each reported within seconds as
  :class:`RayConnectionError`, saying why and what to set, and nothing else is printed. The
  token itself is never printed or logged.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.runtime.errors import GraphError, PipelineError

__all__ = [
    "AUTH_MODE_ENV",
    "AUTH_TOKEN_ENV",
    "AUTH_TOKEN_PATH_ENV",
    "CONNECT_TIMEOUT",
    "PROBE_TIMEOUT",
    "RayConnectionError",
    "RayUnavailableError",
    "check_versions",
    "connect_ray",
    "default_token_path",
    "import_ray",
    "require_ray",
]

logger = logging.getLogger("actorline.ray")

#: Ray's variables (ray/_private/authentication): the mode ("token", "disabled"), the token,
#: a file holding it
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
#: the cluster ``ray.init(address=None)`` connects to when set
RAY_ADDRESS_ENV = "RAY_ADDRESS"
#: seconds a TCP connection to the cluster's address may take
CONNECT_TIMEOUT = 10.0
#: seconds the probe may take (a fresh interpreter importing Ray, then the GCS's answer)
PROBE_TIMEOUT = 30.0
#: what to set, in the words of every token refusal
_WHERE_TOKENS_GO = (
    "give the cluster's token (`ray get-auth-token` on its head prints it) in "
    "~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or as ray_auth_token_file "
    "(--ray-auth-token-file FILE)"
)


class RayUnavailableError(GraphError):
    """A host was placed on Ray, but Ray is not installed (``pip install actorline[ray]``)."""


class RayConnectionError(PipelineError, ValueError):
    """This process cannot join the Ray cluster it was given: nothing answers at the address,
    the cluster refuses its token (or wants one it lacks), or runs another Ray or Python
    version. The message is one line saying which and what to set; it never holds the token."""


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        RayUnavailableError: Ray is not installed (the message says how to install it).
    """
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError(
            "a host is placed on Ray, but Ray is not installed: pip install 'actorline[ray]'"
        ) from exc
    return ray


def require_ray() -> None:
    """Check that Ray can be imported.

    Raises:
        RayUnavailableError: it cannot (the message says how to install it).
    """
    import_ray()


def default_token_path() -> Path:
    """Where Ray keeps a user's token: ``~/.ray/auth_token`` (``ray get-auth-token
    --generate`` writes it, ``ray start --head`` and ``ray.init()`` read it)."""
    return Path.home() / ".ray" / "auth_token"


def connect_ray(address: str | None, auth_token_file: str | None = None) -> bool:
    """Connect this process to Ray: to the cluster at ``address`` ("auto": the one running
    here; None: ``RAY_ADDRESS`` if set, else a new local cluster), unless it is connected
    already, with the cluster's token where it wants one (see the module docstring):
    ``auth_token_file`` if given, else where Ray finds it.

    Returns:
        Whether this call started the connection (its owner shuts it down).

    Raises:
        RayUnavailableError: Ray is not installed.
        RayConnectionError: the cluster cannot be reached, refuses this process's token (or
            wants one it lacks), runs another Ray or Python version, or ``auth_token_file``
            cannot be read.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if auth_token_file is not None:
        _use_token_file(auth_token_file)
    _check_token_path_variable()
    target = address if address is not None else os.environ.get(RAY_ADDRESS_ENV) or None
    gcs = None
    if target is not None and not target.startswith("ray://"):
        gcs = _gcs_address(target)
        _probe(gcs)
    try:
        # NOTE: the GCS found, not "auto": given "auto", ray.init would turn token mode on
        # wherever a token exists, asked for or not (ray/_private/worker.py)
        ray.init(address=gcs or address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
        where = f"the Ray cluster at {target}" if target else "a new local Ray cluster"
        raise RayConnectionError(f"cannot connect to {where}: {_first_line(exc)}") from exc
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _use_token_file(path: str) -> None:
    """Token mode with the token in ``path`` for this process and those it starts.

    Raises:
        RayConnectionError: ``path`` cannot be read or holds no token.
    """
    file = Path(path).expanduser()
    try:
        token = file.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RayConnectionError(f"ray_auth_token_file {path!r} cannot be read: {reason}") from None
    if not token:
        raise RayConnectionError(f"ray_auth_token_file {path!r} is empty: it holds no token")
    del token
    # NOTE: Ray's loader takes RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH: the file given wins
    os.environ.pop(AUTH_TOKEN_ENV, None)
    os.environ[AUTH_TOKEN_PATH_ENV] = str(file.resolve())
    _set_token_mode()


def _check_token_path_variable() -> None:
    """Refuse a ``RAY_AUTH_TOKEN_PATH`` that names no readable token: Ray's C++ loader
    aborts the whole process on one (its token-authentication design doc)."""
    path = os.environ.get(AUTH_TOKEN_PATH_ENV)
    if not path or os.environ.get(AUTH_TOKEN_ENV):
        return
    try:
        empty = not Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RayConnectionError(f"RAY_AUTH_TOKEN_PATH {path!r} cannot be read: {reason}") from None
    if empty:
        raise RayConnectionError(f"RAY_AUTH_TOKEN_PATH {path!r} is empty: it holds no token")


def _set_token_mode() -> None:
    """Token mode for this process (and the processes it starts), Ray's cached configuration
    and token refreshed, as ``ray.init`` turns it on (authentication_token_setup.py)."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    os.environ[AUTH_MODE_ENV] = "token"
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _token_source() -> str | None:
    """Where Ray's loader finds a token now, in its order (the token's source, never the
    token), or None."""
    if os.environ.get(AUTH_TOKEN_ENV):
        return AUTH_TOKEN_ENV
    if path := os.environ.get(AUTH_TOKEN_PATH_ENV):
        return f"{AUTH_TOKEN_PATH_ENV} ({path})"
    default = default_token_path()
    try:
        if default.read_text().strip():
            return str(default)
    except (OSError, UnicodeDecodeError):
        pass
    return None


def _gcs_address(target: str) -> str:
    """The ``host:port`` of the GCS that ``target`` names ("auto": the cluster running here).

    Raises:
        RayConnectionError: "auto" finds no cluster running here.
    """
    if target != "auto":
        return target
    from ray._private import services

    try:
        found = services.canonicalize_bootstrap_address(target)
    except ConnectionError as exc:
        found = None
        reason = _first_line(exc)
    else:
        reason = "no cluster was started here"
    if not found:
        raise RayConnectionError(
            f"ray address 'auto' finds no Ray cluster running on this machine ({reason}): "
            "start one with `ray start --head`, or give the address it printed"
        )
    return str(found)


def _split(address: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) as a pair.

    Raises:
        RayConnectionError: it is not of that form.
    """
    host, colon, port = address.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayConnectionError(
            f"ray address {address!r} is not HOST:PORT (the address `ray start --head` "
            "prints, e.g. 10.0.0.5:6379), 'auto' or ray://HOST:PORT"
        )
    return host, int(port)


def _probe(gcs: str) -> None:
    """Check that the GCS at ``gcs`` answers and takes this process, turning token mode on
    when it asks for a token and ``RAY_AUTH_MODE`` is unset (see the module docstring).

    Raises:
        RayConnectionError: it does not, saying why.
    """
    host, port = _split(gcs)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            pass
    except socket.gaierror as exc:
        raise RayConnectionError(
            f"cannot resolve the Ray address {gcs!r}: {exc.strerror}"
        ) from None
    except TimeoutError:
        raise RayConnectionError(
            f"no Ray cluster answers at {gcs}: no answer within {CONNECT_TIMEOUT:g} s (a "
            "firewall, or a host that is down)"
        ) from None
    except OSError as exc:
        raise RayConnectionError(
            f"no Ray cluster at {gcs}: {exc.strerror or exc} (give the address `ray start "
            "--head` printed; `ray status` on the head shows it)"
        ) from None
    mode_set = AUTH_MODE_ENV in os.environ
    metadata = _ask_gcs(gcs, can_retry_with_token=not mode_set)
    check_versions(gcs, metadata)


#: the probe, run by a fresh interpreter (see :func:`_ask_gcs`): argv is the GCS address and
#: "retry" where it may ask again in token mode; it prints one JSON line
_PROBE_SCRIPT = r"""
import json, os, sys
from ray._common.usage.usage_lib import get_cluster_metadata
from ray._raylet import AuthenticationTokenLoader, Config, GcsClient
from ray.exceptions import AuthenticationError

def ask():
    return get_cluster_metadata(GcsClient(address=sys.argv[1]))

def answer(**fields):
    print(json.dumps(fields), flush=True)
    sys.exit(0)

try:
    try:
        answer(metadata=ask(), token_mode=False)
    except AuthenticationError:
        if sys.argv[2] != "retry":
            raise
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    answer(metadata=ask(), token_mode=True)
except AuthenticationError:
    answer(refused=True)
except Exception as exc:
    lines = str(exc).strip().splitlines() or [""]
    answer(error=f"{type(exc).__name__}: {lines[0]}")
"""


def _ask_gcs(gcs: str, *, can_retry_with_token: bool) -> dict[str, Any]:
    """The cluster metadata of the GCS at ``gcs`` (its Ray and Python versions), turning
    token mode on in this process where the GCS asks for a token, ``can_retry_with_token``
    and a token is found.

    NOTE: Ray's GCS client runs in a fresh interpreter, as ``ray status`` would: it logs each
    refusal to stderr from C++ (which this process's one-line error replaces), retries for
    40 s where something that is not a GCS answers (the interpreter is ended at
    PROBE_TIMEOUT), and aborts its process on some misconfigurations.

    Raises:
        RayConnectionError: the GCS does not answer as one, or refuses this process.
    """
    source = _token_source()
    token_mode = os.environ.get(AUTH_MODE_ENV, "").lower() == "token"
    if token_mode and source is None:  # (Ray's client would not even ask)
        raise RayConnectionError(
            f"RAY_AUTH_MODE is 'token' here, but no token was found to join the Ray cluster "
            f"at {gcs}: {_WHERE_TOKENS_GO}"
        )
    retry = can_retry_with_token and source is not None
    command = [sys.executable, "-c", _PROBE_SCRIPT, gcs, "retry" if retry else "once"]
    try:
        probe = subprocess.run(
            command, capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise RayConnectionError(
            f"{gcs} answers, but not as a Ray cluster's GCS within {PROBE_TIMEOUT:g} s: give "
            "the GCS address `ray start --head` printed (port 6379 by default), not the "
            "dashboard's or the client server's"
        ) from None
    try:
        reply = json.loads(probe.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = probe.stderr.strip().splitlines()[-1:] or [f"exit status {probe.returncode}"]
        raise RayConnectionError(f"probing the Ray cluster at {gcs} failed: {last[0]}") from None
    if "metadata" in reply:
        if reply["token_mode"]:
            logger.info(
                "the Ray cluster at %s asks for a token: sending the one in %s", gcs, source
            )
            _set_token_mode()
        metadata = reply["metadata"]
        return metadata if isinstance(metadata, dict) else {}
    if "error" in reply:
        raise RayConnectionError(
            f"the Ray cluster at {gcs} did not answer as expected: {reply['error']}"
        )
    if source is not None and (token_mode or retry):
        raise RayConnectionError(
            f"the Ray cluster at {gcs} refused this process's token (from {source}): it is "
            f"not the cluster's; {_WHERE_TOKENS_GO}"
        )
    if AUTH_MODE_ENV in os.environ and not token_mode:
        raise RayConnectionError(
            f"the Ray cluster at {gcs} requires token authentication, but RAY_AUTH_MODE is "
            f"{os.environ[AUTH_MODE_ENV]!r} here: unset it or set it to 'token', and "
            f"{_WHERE_TOKENS_GO}"
        )
    raise RayConnectionError(
        f"the Ray cluster at {gcs} requires token authentication and this process has no "
        f"token: {_WHERE_TOKENS_GO}"
    )


def check_versions(gcs: str, metadata: dict[str, Any]) -> None:
    """Refuse the cluster at ``gcs`` whose ``metadata`` (as its GCS publishes it) names a Ray or
    Python version this process does not have, as Ray does
    (``ray._private.utils.check_version_info``), in one line.

    Raises:
        RayConnectionError: the versions differ.
    """
    if not metadata:
        return
    from ray._private.utils import check_version_info, compute_version_info

    try:
        check_version_info(metadata, "this process")
    except RuntimeError:
        ours = compute_version_info()
        raise RayConnectionError(
            f"the Ray cluster at {gcs} runs Ray {metadata.get('ray_version')} on Python "
            f"{metadata.get('python_version')}, this process Ray {ours[0]} on Python "
            f"{ours[1]}: Ray joins only the same versions; install ray=="
            f"{metadata.get('ray_version')} on Python {metadata.get('python_version')} here "
            f"({sys.executable})"
        ) from None
