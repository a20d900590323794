"""`distrib timeline merge`: the per-rank timelines of an MPI job (trace.rank<N>.json) as one trace."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser("merge", help="merge traces (each rank's, from DISTRIB_TIMELINE under mpirun) into one",
                               description="Merges traces into one that Perfetto opens with a track group per rank.")
    merge.add_argument("traces", nargs="+", help="the traces to merge, e.g. trace.rank*.json")
    merge.add_argument("-o", "--output", required=True, help="the merged trace to write, e.g. trace.json")
    merge.set_defaults(subparser=merge)


def run(args: argparse.Namespace) -> int:
    from distrib import timeline

    try:
        path = timeline.merge(args.traces, args.output)
    except (OSError, ValueError) as exc:
        print(f"distrib timeline merge: {exc}", file=sys.stderr)
        return 2
    count = len(args.traces)
    print(f"wrote {path} ({count} trace{'' if count == 1 else 's'})")
    return 0
