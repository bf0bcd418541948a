"""Internal: ``python -m pipeline._host_main FD`` runs a spawned host (see pipeline._process)."""

import sys

from pipeline._process import serve_host

if __name__ == "__main__":
    serve_host(int(sys.argv[1]))
