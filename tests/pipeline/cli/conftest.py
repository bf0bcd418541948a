"""The CLI's entry point called in this process, for the modules here whose subject is
not the process itself (test_cli.py, test_model_cache_cli.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from pipeline.cli import main
from pipeline.runtime.prespawn import discard_prespawned
from stages import tokenize

#: ``main(argv)`` run in this process: its exit status, stdout and stderr
InProcess = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def _no_prespawned_host_left() -> Iterator[None]:
    """``generate`` and ``serve`` prespawn an engine host first thing; in this process at
    most one waits at a time (the in-process cases share it), killed when the module ends
    (what the CLI's atexit hook does when its process exits)."""
    yield
    discard_prespawned()


@pytest.fixture
def actorline_in_process(
    _no_prespawned_host_left: None, capsys: pytest.CaptureFixture[str]
) -> Iterator[InProcess]:
    """The CLI's entry point called in this process (``SystemExit`` from argparse read as
    the exit status), with what it leaves in the process (the OpenMP variables, the
    tokenizer prefetch) undone afterwards."""
    environ = dict(os.environ)
    prefetched = set(tokenize._PREFETCHED)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            status = main(list(args))
        except SystemExit as exit:
            assert isinstance(exit.code, int), exit.code
            status = exit.code
        out, err = capsys.readouterr()
        return status, out, err

    yield run
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)
    for model in set(tokenize._PREFETCHED) - prefetched:
        tokenize._PREFETCHED.pop(model, None)
