"""`distrib bench`'s output: nccl-tests' plain text row by row when piped; a progress bar, then a rich table, on a
terminal. Only the process that reports (rank 0 under mpirun) makes one."""

from __future__ import annotations

import sys


class Output:
    """Plain nccl-tests text, row by row, when piped; a progress bar and then a rich table on a terminal.

    Args:
      steps: measurements the progress bar counts.
      plain: plain text even on a terminal (under mpirun, whose ranks write to a pseudo-terminal).
    """

    def __init__(self, steps: int, plain: bool = False):
        self.rich = not plain and sys.stdout.isatty() and _has_rich()
        self._rows: list[str] = []
        self._head: list[str] = []
        if self.rich:
            from rich.progress import Progress

            self._progress = Progress(transient=True)
            self._task = self._progress.add_task("measuring", total=steps)
            self._progress.start()

    def __repr__(self) -> str:
        return f"<Output {'rich' if self.rich else 'plain'}>"

    def lines(self, lines: list[str]) -> None:
        if self.rich:
            self._head = lines
        else:
            print("\n".join(lines), flush=True)

    def advance(self, what: str) -> None:
        if self.rich:
            self._progress.update(self._task, advance=1, description=what)

    def row(self, text: str) -> None:
        if self.rich:
            self._rows.append(text)
        else:
            print(text, flush=True)

    def done(self, lines: list[str]) -> None:
        if not self.rich:
            print("\n".join(lines), flush=True)
            return
        from rich.console import Console
        from rich.table import Table

        self._progress.stop()
        console = Console()
        titles, names = self._head[-3], self._head[-2].lstrip("#").split()
        for line in self._head[:-3]:
            console.print(line, highlight=False, markup=False)
        table = Table(title=" | ".join(t for t in titles.split("  ") if t.strip()), title_justify="left")
        for name in names:
            table.add_column(name, justify="right")
        for text in self._rows:
            table.add_row(*text.split())
        console.print(table)
        for line in lines:
            console.print(line, highlight=False, markup=False)


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True
