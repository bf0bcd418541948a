"""``python -m pipeline.runtime.host_main FD [--preload MODULES] [--zygote]`` runs a spawned
host (see :mod:`pipeline.runtime.processes`; ``--preload``: :mod:`pipeline.runtime.prespawn`),
or with ``--zygote`` a zygote that forks hosts (:mod:`pipeline.runtime.zygote`)."""

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
    from pipeline.runtime.zygote import ZYGOTE_FLAG, serve_zygote

    control_fd, options = int(sys.argv[1]), sys.argv[2:]
    preload: list[str] = []
    if PRELOAD_FLAG in options:
        preload = [name for name in options[options.index(PRELOAD_FLAG) + 1].split(",") if name]
    if ZYGOTE_FLAG in options:
        forked = serve_zygote(control_fd, preload)
        if forked is not None:  # a host forked by the zygote: its imports are done
            serve_host(forked)
    else:
        serve_host(control_fd, preload)
