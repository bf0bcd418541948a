"""The committed stubs are what grpcio-tools generates from generation.proto today."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc_tools.protoc

import pipeline.server

REPOSITORY = Path(__file__).resolve().parents[3]
PROTO = Path("pipeline/server/generation.proto")
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
#: lines that only record the generator's version
VERSION_LINE = re.compile(r"^(# Protobuf Python Version:|GRPC_GENERATED_VERSION =|    \d+,$)")


def _normalized(text: str) -> list[str]:
    return [line for line in text.splitlines() if not VERSION_LINE.match(line)]


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    (tmp_path / PROTO.parent).mkdir(parents=True)
    result = subprocess.run(
        [
            sys.executable, "-m", grpc_tools.protoc.__name__, f"-I{REPOSITORY}",
            f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            str(REPOSITORY / PROTO),
        ],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stale = [
        name
        for name in GENERATED
        if _normalized((tmp_path / PROTO.parent / name).read_text())
        != _normalized((REPOSITORY / PROTO.parent / name).read_text())
    ]
    assert not stale, (
        f"{', '.join(stale)} are stale; regenerate them as pipeline/server/__init__.py says"
    )


def test_the_docstring_shows_how_to_regenerate() -> None:
    assert pipeline.server.__doc__ is not None
    command = " ".join(pipeline.server.__doc__.replace("\\\n", " ").split())
    assert (
        "python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. " in command
    )
    assert str(PROTO) in command
