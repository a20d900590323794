"""The `distrib` command: `distrib train` (the main job), `distrib bench` (collective throughput), `distrib info`,
`distrib timeline merge`."""

from __future__ import annotations

import argparse
import os
import sys

from distrib._version import __version__

COMMANDS = {
    "train": "train the bundled digits MLP data-parallel on every GPU, or on the CPU emulator",
    "bench": "time a collective in nccl-tests' format, beside raw NCCL (GPUs) or raw NumPy (emulator)",
    "info": "the backend distrib picks here and why, the GPUs and their links, the versions",
    "timeline": "merge the collective timelines of an MPI job's ranks into one trace",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: one subcommand per entry of COMMANDS, each listed in `distrib --help`."""
    from distrib.cli.bench import command as bench
    from distrib.cli import info, timeline
    from distrib.cli.train import OneLineParser

    # every subcommand's parser is one of these too (argparse makes them of the parent's class): errors in one line
    parser = OneLineParser(prog="distrib", description="tf.distribute's programming model on CuPy/NCCL and a NumPy "
                                                       "CPU emulator.")
    parser.add_argument("--version", action="version", version=f"distrib {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help=COMMANDS["train"], add_help=False)  # its own parser reads the rest
    train.add_argument("rest", nargs=argparse.REMAINDER)
    for name, module in (("bench", bench), ("info", info), ("timeline", timeline)):
        command = commands.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])
        # the parser that refuses arguments it does not know, so that the message names it (timeline merge sets its own)
        command.set_defaults(subparser=command)
        module.add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Dispatches `distrib train ...`, `distrib bench ...` and `distrib info`; returns the exit status: 1 where its
    output could not be written (a full disk), even after a run that otherwise succeeded."""
    from distrib.cli.closed_output import output_failed

    try:
        status = _dispatch(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --version and --help print, then exit 0
        if exc.code in (0, None) and output_failed():
            raise SystemExit(1) from None
        raise
    return 1 if status == 0 and output_failed() else status


def _dispatch(argv: list[str]) -> int:
    for name in ("stdout", "stderr"):  # started with that descriptor closed (`>&-`): its output goes nowhere, as a
        if getattr(sys, name) is None:  # C program's writes to a closed descriptor do, instead of an AttributeError
            setattr(sys, name, open(os.devnull, "w"))
            setattr(sys, f"__{name}__", getattr(sys, name))
    if sys.stdout is sys.__stdout__:  # the command's own output, not a caller's capture
        from distrib.cli.closed_output import finish_when_output_closes

        finish_when_output_closes()
    if argv[:1] == ["train"]:  # train's flags go to its own parser, -h included
        from distrib.cli.train import main as train_main

        return _timeline_problem("train") or train_main(argv[1:])
    args, unknown = build_parser().parse_known_args(argv)  # --version and --help first: they record nothing
    if unknown:  # refused by the subcommand's parser, so that the message names it: "distrib info: error: ..."
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    problem = _timeline_problem(args.command)
    if problem:
        return problem
    if args.command == "bench":
        from distrib.cli.bench.command import run
    elif args.command == "timeline":
        from distrib.cli.timeline import run
    else:
        from distrib.cli.info import run
    from distrib.errors import WorkerFailedError
    from distrib.mpi_env import reports_for_the_job

    files = [f for f in (getattr(args, "json", None), getattr(args, "plot", None)) if isinstance(f, str)]
    not_written = f"; {' and '.join(files)} not written" if files else ""
    try:
        return run(args)
    except KeyboardInterrupt:  # Ctrl-C: the rows printed so far stand; one line instead of a traceback
        sys.stderr.write(f"distrib {args.command}: interrupted{not_written}.\n")
        return 130
    except WorkerFailedError as exc:  # under mpirun: Ctrl-C reached mpirun, which ends every rank; or a rank failed
        if reports_for_the_job() or 0 in exc.ranks:  # rank 0 reports, or the others if it died
            sys.stderr.write(f"distrib {args.command}: stopped{not_written}: {exc}\n")  # one write: ranks share the log
        return 1


def _timeline_problem(command: str) -> int:
    """Exit status 2, after one line on stderr, where DISTRIB_TIMELINE cannot be recorded (`import distrib` leaves
    it to be refused here, as every variable the command cannot use is); 0 if it can. Under mpirun rank 0 says it,
    or the rank whose own file (trace.rank<N>.json) it is."""
    from distrib import timeline
    from distrib.mpi_env import mpi_environment

    try:
        timeline.check_environment()
    except OSError as exc:
        try:
            launched = mpi_environment()
        except ValueError:
            launched = None
        rank = None if launched is None or launched[2] < 2 else launched[1]
        if not rank or repr(timeline.rank_path(os.environ.get(timeline.ENV, "").strip(), rank)) in str(exc):
            sys.stderr.write(f"distrib {command}: error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
