"""``python -m process_probe [EXIT_CODE]``: prints, as one JSON line, what this process was started with and
what torch sees in it (threads, a seeded draw), writes a line to stderr, and exits with EXIT_CODE. The
launcher tests run it forked and plain and compare."""

import json
import os
import sys

import torch

if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps({
        "pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv[1:], "name": __name__,
        "home": os.environ.get("DIFFUSE_HOME"), "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "draw": torch.randn(64, 64).matmul(torch.randn(64, 64)).sum().item(),
    }), flush=True)
    print("probe: on stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
