"""Run under `mpirun -np 2`: `distrib bench` of every collective in one launch, each writing argv[1]/<name>.json;
rank 0 prints the tables. Then a broadcast from a root it refuses, and an all_reduce whose raw results rank 1
corrupts (3 elements of its first device's), which rank 0 must count."""

from __future__ import annotations

import sys

import numpy as np

from distrib import cli
from distrib.cli.bench import mpi

QUICK = ["-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1"]
status = 0
for collective, extra in (("all_reduce", []), ("all_gather", []), ("reduce_scatter", []), ("broadcast", ["-r", "1"]),
                          ("reduce", ["-r", "3", "-o", "avg"]), ("batch_reduce", ["-e", "2K"])):
    status |= cli.main(["bench", collective, *QUICK, *extra, "--json", f"{sys.argv[1]}/{collective}.json"])
try:  # rank 2 is on process 1: distrib broadcasts from the chief's process, so this is refused on every rank
    cli.main(["bench", "broadcast", *QUICK, "-r", "2"])
except SystemExit as exc:
    status |= exc.code != 2

prepare = mpi.MpiSeries.prepare


def corrupted_on_rank_1(self, spec):
    prepared = prepare(self, spec)
    outputs = prepared.outputs
    if self.comm.Get_rank() == 1:
        prepared.outputs = lambda result: [np.where(np.arange(a.size) < 3, a + 1, a) if i == 0 else a
                                           for i, a in enumerate(outputs(result))]
    return prepared


mpi.MpiSeries.prepare = corrupted_on_rank_1
status |= cli.main(["bench", "all_reduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "--json",
                    f"{sys.argv[1]}/corrupted.json"]) != 1  # the exit status says some element was wrong
sys.exit(status)
