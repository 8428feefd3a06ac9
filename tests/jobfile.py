"""The command line the reference scripts that take a file of jobs share: ``--jobs FILE.json --threads N --out
RESULTS.json``, each job run in this process, its result (or its one-line error) written in order."""

from __future__ import annotations

import argparse
import json


def run_jobs(run_one, description: str, argv: list[str] | None = None) -> int:
    """Parse the command line, run ``run_one(job)`` (a dict of results) on every job, write the list."""
    import torch

    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--jobs", required=True, help="a JSON list of jobs, each a map")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's own default)")
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.jobs) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        try:
            results.append(run_one(job))
        except Exception as exc:  # noqa: BLE001 - this job's failure is reported in its own entry
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0
