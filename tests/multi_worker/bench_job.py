"""Run under `mpirun -np 2`: `distrib bench` of every collective in one launch, each writing argv[1]/<name>.json;
rank 0 prints the tables; then a broadcast from a root it refuses."""

from __future__ import annotations

import sys

from distrib import cli

QUICK = ["-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1"]
status = 0
for collective, extra in (("all_reduce", []), ("all_gather", []), ("reduce_scatter", []), ("broadcast", ["-r", "1"]),
                          ("reduce", ["-r", "3", "-o", "avg"]), ("batch_reduce", ["-e", "2K"])):
    status |= cli.main(["bench", collective, *QUICK, *extra, "--json", f"{sys.argv[1]}/{collective}.json"])
try:  # rank 2 is on process 1: distrib broadcasts from the chief's process, so this is refused on every rank
    cli.main(["bench", "broadcast", *QUICK, "-r", "2"])
except SystemExit as exc:
    status |= exc.code != 2
sys.exit(status)
