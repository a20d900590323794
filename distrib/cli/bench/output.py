"""`distrib bench`'s output: nccl-tests' plain text row by row when piped; a progress bar, then a rich table, on a
terminal. Only the process that reports (rank 0 under mpirun) makes one."""

from __future__ import annotations

import importlib.util
import re
import sys

WIDE = 100_000  # a console width no table reaches: what a table needs when nothing constrains it


class Output:
    """Plain nccl-tests text, row by row, when piped; a progress bar and then a rich table on a terminal (the plain
    text if the table is wider than the terminal: rich would cut its numbers).

    Args:
      steps: measurements the progress bar counts.
      plain: plain text even on a terminal (under mpirun, whose ranks write to a pseudo-terminal).
    """

    def __init__(self, steps: int, plain: bool = False):
        self.rich = not plain and sys.stdout.isatty() and _has_rich()
        self._rows: list[str] = []
        self._head: list[str] = []
        self._open = self.rich  # the progress bar runs and the rows wait for the table
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
        """The table and then the footer `lines`."""
        self.close()
        if not self.rich:
            print("\n".join(lines), flush=True)
            return
        from rich.console import Console

        console = Console()
        for line in lines:
            console.print(line, highlight=False, markup=False)

    def close(self) -> None:
        """Stops the progress bar (which shows the cursor again) and prints the rows measured so far: on Ctrl-C or
        an error part-way, the rows a rich table was holding back are not lost."""
        if not self._open:
            return
        self._open = False
        self._progress.stop()
        if not self._head:  # stopped before the header: no table to show
            return
        from rich.console import Console
        from rich.measure import Measurement

        console = Console()
        table = self._table()
        if table is None or Measurement.get(console, console.options.update_width(WIDE), table).minimum > console.width:
            # rich would cut the numbers to "…": nccl-tests' text instead, which the terminal wraps whole
            print("\n".join(self._head + self._rows), flush=True)
            return
        for line in self._head[:-3]:
            console.print(line, highlight=False, markup=False)
        console.print(table)

    def _table(self):
        from rich.table import Table

        if len(self._head) < 3:
            return None
        titles, names = self._head[-3], self._head[-2].lstrip("#").split()
        groups = [t for t in re.split(r"\s{2,}", titles.lstrip("#")) if t.strip()]
        extra = " ".join(names[5 + len(groups) * 4:])  # the extra column's name may hold spaces ("vs raw")
        table = Table()
        for k, name in enumerate(names[:5 + len(groups) * 4] + ([extra] if extra else [])):
            group, first = divmod(k - 5, 4)
            title = f"{groups[group]}\n{name}" if 0 <= group < len(groups) and first == 0 and k >= 5 else f"\n{name}"
            # titles may wrap between words; a number has none, so rich keeps it whole or, at worst, folds it
            table.add_column(title, justify="right", overflow="fold")
        for text in self._rows:
            table.add_row(*text.split())
        return table


def _has_rich() -> bool:
    return importlib.util.find_spec("rich") is not None
