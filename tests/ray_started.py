"""A Ray cluster as users start one: ``ray start --head`` in a subprocess, with its own home
directory (where Ray keeps the default token, ``~/.ray/auth_token``), its own temporary
directory and free ports, stopped (and checked gone) by :meth:`StartedRay.stop`.

NOTE: never ``ray stop``: it kills every Ray process of the machine (the session's cluster,
other test runs'). The head runs with ``--block`` in a session of its own: its Ray processes
are its descendants, in that session, and Ray's reaper ends them when it is terminated; any
left over is found by its session and killed by pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.runtime.settings import cache_dir

__all__ = [
    "RAY_START_TIMEOUT",
    "StartedRay",
    "StartedRayNode",
    "free_port",
    "generate_token",
    "ray_processes",
    "user_environment",
]

#: seconds ``ray start --head`` may take to report the cluster up (a loaded 2-core machine)
RAY_START_TIMEOUT = 90.0
#: heads started before giving up (see StartedRay)
START_ATTEMPTS = 2
#: seconds the head's processes may take to go once it is terminated
STOP_TIMEOUT = 30.0
#: Ray's variables a test's environment must not inherit from the test process (which may be
#: connected to the session's cluster with token authentication on)
RAY_VARIABLES = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
ADDRESS_LINE = re.compile(r"ray start --address='([^']+)'")


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def user_environment(home: Path | None = None, **variables: str) -> dict[str, str]:
    """This process's environment without Ray's variables (see RAY_VARIABLES), with
    ``variables`` and, given one, ``home`` as the home directory. Its actorline cache stays
    this process's (``ACTORLINE_CACHE_DIR``): a fresh home would otherwise be a fresh cache,
    and every cluster's engine would compile the C kernels again."""
    env = {k: v for k, v in os.environ.items() if k not in RAY_VARIABLES}
    env.setdefault("ACTORLINE_CACHE_DIR", str(cache_dir()))
    if home is not None:
        env["HOME"] = str(home)
    return {**env, **variables}


def generate_token(home: Path) -> None:
    """Give the user whose home is ``home`` a Ray token, as Ray's CLI does (``ray
    get-auth-token --generate`` writes ``home/.ray/auth_token``; ``ray.init()`` would too)."""
    subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "get-auth-token", "--generate"],
        env=user_environment(home),
        capture_output=True,
        check=True,
        timeout=120,
    )


def ray_processes(session: int) -> dict[int, str]:
    """Live processes of session ``session`` (a cluster's head runs in a session of its own,
    and every Ray process it starts stays in it), mapped to their command lines (Ray's
    workers retitle theirs: ``ray::IDLE``, ``ray::_HostActor...``)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            found[int(entry.name)] = command.strip()
    return found


class StartedRay:
    """``ray start --head --block`` with ``home`` as its home directory (Ray's default token
    is ``home/.ray/auth_token``) and ``variables`` set (e.g. ``RAY_AUTH_MODE``); 2 CPUs,
    no dashboard, every port it opens chosen free. :attr:`address` is the address it prints
    for other nodes and drivers. :meth:`environment` is what a driver of the same user has.

    Raises (from the constructor): AssertionError when the head does not report the cluster
    up within RAY_START_TIMEOUT, START_ATTEMPTS times (each is stopped; the message shows the
    last one's output).
    """

    def __init__(self, home: Path, **variables: str) -> None:
        self.home = home
        self._variables = variables
        for attempt in range(1, START_ATTEMPTS + 1):
            self._launch()
            try:
                self.address = self._wait_up()
                return
            except AssertionError:
                # NOTE: Ray gives its raylet 30 s to register (ray/_private/node.py), which a
                # loaded 2-core machine can miss: a fresh head once more
                if attempt == START_ATTEMPTS:
                    raise

    def _launch(self) -> None:
        # NOTE: short: Ray's unix sockets live under it (a socket path has 107 bytes at most)
        self.temp_dir = tempfile.mkdtemp(prefix="alray-", dir="/tmp")
        self.log_path = Path(self.temp_dir) / "start.log"
        ports = {
            "--port": free_port(),
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
            "--ray-client-server-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--runtime-env-agent-port": free_port(),
            "--metrics-export-port": free_port(),
        }
        command = [
            str(Path(sys.executable).with_name("ray")),
            "start",
            *self._role(),
            "--block",
            "--disable-usage-stats",
            "--temp-dir",
            self.temp_dir,
            *(f"{flag}={port}" for flag, port in ports.items() if self._takes(flag)),
        ]
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(**self._variables),
            start_new_session=True,
        )

    def _role(self) -> list[str]:
        """``ray start``'s arguments that make this node the head (2 CPUs, no dashboard)."""
        return ["--head", "--num-cpus", "2", "--include-dashboard", "false"]

    def _takes(self, flag: str) -> bool:
        """Whether this node's ``ray start`` takes the port flag ``flag``."""
        return True

    def environment(self, **variables: str) -> dict[str, str]:
        """This process's environment for a process of the cluster's user: its home, none of
        Ray's own variables but ``variables``."""
        return user_environment(self.home, **variables)

    def processes(self) -> dict[int, str]:
        """The cluster's live processes (the head's session), pid → command line."""
        return ray_processes(self.process.pid)

    @property
    def output(self) -> str:
        """What ``ray start`` printed so far."""
        return self.log_path.read_text(errors="replace")

    def _wait_up(self) -> str:
        deadline = time.monotonic() + RAY_START_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            if "block forever" in self.output and (address := self._address()):
                return address
            time.sleep(0.2)
        output = self.output
        self.stop()
        raise AssertionError(f"ray start {self._role()[0]} did not come up:\n{output[-3000:]}")

    def _address(self) -> str | None:
        """The cluster's address as ``ray start`` printed it (None: not yet)."""
        match = ADDRESS_LINE.search(self.output)
        return match.group(1) if match else None

    def stop(self) -> None:
        """Terminate the head (Ray's reaper ends its processes), wait for them all to go,
        kill any left by pid, and remove the temporary directory. Idempotent.

        Raises:
            AssertionError: some process of the cluster was still alive after STOP_TIMEOUT
                (it is killed first).
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        deadline = time.monotonic() + STOP_TIMEOUT
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"


class StartedRayNode(StartedRay):
    """A second node joining the cluster of ``head`` as users add one: ``ray start --address
    HEAD --block`` with ``num_cpus`` CPUs and the custom ``resources`` (``ray start
    --resources``), the head's user (home) and ``variables``, its own temporary directory and
    free ports; on this machine, so two nodes share an IP and differ by their node ids.
    :attr:`address` is the head's. Stopped as the head is (:meth:`StartedRay.stop`): stop the
    node before the head.

    Raises (from the constructor): AssertionError as :class:`StartedRay`.
    """

    def __init__(
        self, head: StartedRay, num_cpus: int, resources: dict[str, float], **variables: str
    ) -> None:
        self.head, self.num_cpus, self.resources = head, num_cpus, resources
        super().__init__(head.home, **variables)

    def _role(self) -> list[str]:
        return [
            "--address",
            self.head.address,
            "--num-cpus",
            str(self.num_cpus),
            "--resources",
            json.dumps(self.resources),
        ]

    def _takes(self, flag: str) -> bool:
        return flag not in ("--port", "--ray-client-server-port")  # the head's only

    def _address(self) -> str | None:
        return self.head.address if "Ray runtime started" in self.output else None
