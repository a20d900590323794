"""`distrib bench`'s output: nccl-tests' plain text row by row when piped; a progress bar, then a rich table, on a
terminal. Only the process that reports (rank 0 under mpirun) makes one."""

from __future__ import annotations

import re
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
        """The preamble, ending with the table's three header lines (from table.header)."""
        if self.rich:
            self._head = [line for text in lines for line in text.split("\n")]
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
        groups = [t for t in re.split(r"\s{2,}", titles.lstrip("#")) if t.strip()]
        extra = " ".join(names[5 + len(groups) * 4:])  # the extra column's name may hold spaces ("vs raw")
        table = Table()
        for k, name in enumerate(names[:5 + len(groups) * 4] + ([extra] if extra else [])):
            group, first = divmod(k - 5, 4)
            title = f"{groups[group]}\n{name}" if 0 <= group < len(groups) and first == 0 and k >= 5 else f"\n{name}"
            table.add_column(title, justify="right")
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
