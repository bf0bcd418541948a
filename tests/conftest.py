"""Shared fixtures: the real default model and a tiny random Llama that shares its tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from pipeline.runtime.settings import cache_dir
from tests.processes import child_processes

#: the run's compiled native kernels (keyed by source, flags and CPU: any cache may use them)
KERNELS = cache_dir() / "kernels"

#: the modules of the Ray tests (the session's ``ray_cluster``, ``ray start --head``
#: subprocesses): one xdist worker runs them all (see xdist_group)
RAY_MODULES = (
    "test_ray_started.py",
    "test_ray_engine.py",
    "test_ray_hosts.py",
    "test_parallel.py",
    "test_pp_ray_nodes.py",
    "test_ray_pipeline_bench.py",
    "test_draft_placement.py",
)


def xdist_group(nodeid: str) -> str:
    """The group of the test ``nodeid`` under ``pytest -n N --dist loadgroup`` (the Makefile's
    test command): a worker runs a group whole, in order. A module is a group (its
    module-scoped servers and engines start once, not once per worker), except that the Ray
    modules are one group ``ray`` (one session cluster, no two clusters at once)."""
    module = nodeid.split("::", 1)[0]
    return "ray" if Path(module).name in RAY_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` groups by :func:`xdist_group`. NOTE: xdist's own loadgroup reads
    ``xdist_group`` marks by renaming each item's ``_nodeid``, which pytest 9 no longer reads
    (``Node.nodeid`` is ``str(self._id)``): its groups came out one test each."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on CUDA machines)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    for item in items:
        uses_ray = "ray_cluster" in getattr(item, "fixturenames", ())
        if uses_ray and item.path.name not in RAY_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} takes ray_cluster: add its module to conftest's RAY_MODULES"
            )


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the test's main thread, as in a terminal.

    NOTE: a shell without job control starts background commands with SIGINT ignored, and
    Python then installs no handler of its own, so a suite launched that way (``make test &``)
    would never see the KeyboardInterrupt these tests send."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted from the installed GGUF (cached)."""
    from stages.models import resolve_model

    return resolve_model("smollm2-135m").path


def imported_after(script: str, packages: Sequence[str], timeout: float = 300) -> list[str]:
    """Which of ``packages`` (top-level names) a fresh interpreter has imported once it has
    run ``script`` (which must succeed): for start-up paths that must not import them."""
    wanted = list(packages)
    report = f"\nimport sys, json\nprint(json.dumps([p for p in {wanted!r} if p in sys.modules]))\n"
    result = subprocess.run(
        [sys.executable, "-c", script + report],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


TINY_LLAMA = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.1,
)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Path:
    """A tiny randomly initialised Llama (seeded), saved as an HF directory with the
    SmolLM2 tokenizer, so every stage can load it like a real model. The tokenizer comes from
    the default model, or from ``ACTORLINE_TEST_TOKENIZER_DIR`` where that is set (a machine
    without the default model's package: ``.ci/cuda-check`` carries the files there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    model.save_pretrained(out)
    carried = os.environ.get("ACTORLINE_TEST_TOKENIZER_DIR")
    source = Path(carried) if carried else request.getfixturevalue("default_model_dir")
    for name in source.iterdir():
        if name.name.startswith("tokenizer") or name.name in (
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            shutil.copy(name, out / name.name)
    return out


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One local Ray cluster for the session (2 CPUs, the dashboard for ``ray.util.state``),
    shut down at its end. Tests that place hosts on Ray use it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False)
    yield ray
    ray.shutdown()


def _host_processes() -> set[str]:
    """Spawned pipeline hosts that are children of this process, as "pid: command line"."""
    return {
        f"{pid}: {command}"
        for pid, command in child_processes().items()
        if "pipeline.runtime.host_main" in command
    }


@pytest.fixture(autouse=True, scope="session")
def no_host_process_left_behind() -> Iterator[None]:
    """Tests must stop the pipelines they start: no host process may outlive the session."""
    yield
    deadline = time.monotonic() + 10
    while (left := _host_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"host processes left behind: {sorted(left)}"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (seeded) written as a GGUF file (Q8_0 matrices, its own byte-level
    tokenizer of 512 tokens), as llama.cpp writes one: converting it writes about 5.8 MB."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.stages.execute.quant.test_apply import GGUF_LLAMA, write_gguf

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **GGUF_LLAMA))
    return write_gguf(source, "Q8_0", tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def share_kernels(cache: Path) -> Path:
    """``cache``, a cache directory of a test's own, created, with the run's compiled kernels
    linked in as its ``kernels``: a test of the model cache starts without converted models,
    not without kernels (a process compiles the five of them again otherwise, the C compiler
    at -O3 for tens of seconds on a loaded machine). Returns ``cache``."""
    KERNELS.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").exists():
        (cache / "kernels").symlink_to(KERNELS, target_is_directory=True)
    return cache


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted on ``directory`` (created) for the
    block, then unmounted: a disk that fills up. Skips the test unless run as root (CI is)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a full disk) needs root; CI runs the tests as root")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        check=True,
        capture_output=True,
    )
    try:
        yield directory
    finally:
        subprocess.run(["umount", "--lazy", str(directory)], check=True, capture_output=True)
