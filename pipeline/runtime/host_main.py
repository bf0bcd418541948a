"""``python -m pipeline.runtime.host_main FD [--preload MODULES]`` runs a spawned host (see
:mod:`pipeline.runtime.processes`; ``--preload``: :mod:`pipeline.runtime.prespawn`)."""

import ctypes
import os
import sys

# glibc's mallopt(M_ARENA_MAX) (malloc.h). A host's threads (torch's and OpenMP's pools, the
# executor) would each get a malloc arena of their own, every one keeping its own freed
# memory; two arenas cut the engine's peak RSS by ~50 MB at the same tokens/s
# (actorline bench offline, alternating runs; docs/performance.md §1). It must happen before
# those threads exist, hence here, before anything else is imported. MALLOC_ARENA_MAX in the
# environment wins.
_M_ARENA_MAX = -8
HOST_ARENA_MAX = 2


def _limit_malloc_arenas() -> None:
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return  # not glibc
    mallopt(_M_ARENA_MAX, HOST_ARENA_MAX)


if __name__ == "__main__":
    _limit_malloc_arenas()
    # before torch (and its OpenMP runtime) is imported, by a preload or by a stage
    from pipeline.runtime.omp_policy import apply_omp_policy

    apply_omp_policy()
    from pipeline.runtime.prespawn import PRELOAD_FLAG
    from pipeline.runtime.processes import serve_host

    preload: list[str] = []
    if len(sys.argv) == 4 and sys.argv[2] == PRELOAD_FLAG:
        preload = [name for name in sys.argv[3].split(",") if name]
    serve_host(int(sys.argv[1]), preload)
