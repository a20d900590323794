"""The `distrib` command: `distrib train` (the main job) and `distrib info` (backend, devices, versions)."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {"train": "the digits MLP job", "info": "the backend, its devices and the versions"}


def main(argv: list[str] | None = None) -> int:
    """Dispatches `distrib train ...` and `distrib info`; each command imports only what it needs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="distrib", description="tf.distribute's programming model on CuPy/NCCL "
                                                                 "and a NumPy CPU emulator.")
    parser.add_argument("command", choices=tuple(COMMANDS),
                        help="; ".join(f"{name}: {what}" for name, what in COMMANDS.items()))
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage and exits
    if argv[0] == "train":
        from distrib.cli.train import main as train_main

        return train_main(argv[1:])
    parser.parse_args(argv)
    from distrib.cli.info import main as info_main

    return info_main()


if __name__ == "__main__":
    sys.exit(main())
