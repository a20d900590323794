"""`distrib bench`'s results as a JSON document with a fixed schema, and as a plot of bus bandwidth against size."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from distrib.install_hint import pip_install

SCHEMA = "distrib-bench/1"
MEASUREMENT_KEYS = {"time_us": float, "algbw_GBps": float, "busbw_GBps": float, "wrong": (int, type(None))}
ROW_KEYS = {"size": int, "count": int, "type": str, "redop": str, "root": int, "results": dict}
TOP_KEYS = {"schema": str, "collective": str, "date": str, "device": str, "backend": str, "emulated": bool,
            "ranks": int, "type": str, "op": str, "root": int, "versions": dict, "settings": dict, "series": list,
            "rows": list, "avg_busbw_GBps": dict, "wrong": int}


def validate(document: dict) -> dict:
    """Checks `document` against the schema (keys and their types); returns it.

    Raises:
      ValueError: a key is missing or has the wrong type; the message names its path.
    """
    _check(document, TOP_KEYS, "")
    if document["schema"] != SCHEMA:
        raise ValueError(f"A distrib bench result has schema {SCHEMA!r}. Received: {document['schema']!r}.")
    for i, row in enumerate(document["rows"]):
        _check(row, ROW_KEYS, f"rows[{i}].")
        if set(row["results"]) != set(document["series"]):
            raise ValueError(f"rows[{i}].results needs one entry per series {document['series']}. Received: "
                             f"{sorted(row['results'])}.")
        for name, measurement in row["results"].items():
            if measurement is not None:
                _check(measurement, MEASUREMENT_KEYS, f"rows[{i}].results[{name!r}].")
    return document


def _check(mapping: Any, keys: dict, where: str) -> None:
    if not isinstance(mapping, dict):
        raise ValueError(f"{where or 'the document'} must be an object. Received: {type(mapping).__name__}.")
    for key, kind in keys.items():
        if key not in mapping:
            raise ValueError(f"A distrib bench result needs {where}{key}. Received keys: {sorted(mapping)}.")
        value = mapping[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}{key} must be {getattr(kind, '__name__', kind)}. Received: {value!r}.")


def write_json(document: dict, path: str | Path) -> Path:
    """Validates and writes the document (infinite bandwidths, from a zero time, become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(validate(document)), indent=1) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def plot_formats() -> set[str]:
    """The file extensions matplotlib writes (png, svg, pdf, ...): --plot is checked against them up front."""
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def plotted_quantity(document: dict) -> str:
    """What the plot draws: bus bandwidth, or algorithm bandwidth where every bus bandwidth is 0 (one rank:
    nccl-tests' factor (n-1)/n is 0, and a chart of nothing helps no one)."""
    busbw = [m["busbw_GBps"] for row in document["rows"] for m in row["results"].values() if m]
    return "busbw_GBps" if any(b for b in busbw if b is not None) else "algbw_GBps"


def plot(document: dict, path: str | Path) -> Path:
    """Bus bandwidth (or algbw, see `plotted_quantity`) against size, both on log scales, one line per series
    (with several types or ops, one per type and op of distrib's first series); the device and date in the title.

    Raises:
      ModuleNotFoundError: matplotlib is missing (the bench extra).
    """
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"--plot needs matplotlib: {pip_install('bench')}.") from exc
    matplotlib.use("Agg")
    from matplotlib import pyplot

    quantity = plotted_quantity(document)
    figure, axes = pyplot.subplots(figsize=(8, 5))
    passes = list(dict.fromkeys((row["type"], row["redop"]) for row in document["rows"]))
    # -d all / -o all: one line per type and op, of distrib's first series only (every series would be dozens)
    lines = [(name, None) for name in document["series"]] if len(passes) == 1 else \
        [(document["series"][0], this) for this in passes]
    if len(lines) > 10:  # matplotlib's default cycle repeats after 10 colours
        axes.set_prop_cycle(color=pyplot.get_cmap("tab20").colors)
    drawn = 0
    for name, this in lines:
        points = [(row["size"], row["results"][name][quantity]) for row in document["rows"]
                  if row["results"].get(name) and row["size"] > 0 and row["results"][name][quantity]
                  and math.isfinite(row["results"][name][quantity])
                  and this in (None, (row["type"], row["redop"]))]
        if points:
            label = name if this is None else f"{name} {this[0]}" + (f" {this[1]}" if this[1] != "none" else "")
            axes.plot(*zip(*points), marker="o", markersize=3, label=label)
            drawn += 1
    axes.set_xlabel("size (bytes)")
    if quantity == "busbw_GBps":
        axes.set_ylabel("bus bandwidth (GB/s)")
    else:
        axes.set_ylabel("algorithm bandwidth (GB/s)" + (": bus bandwidth is 0 on one rank" if document["ranks"] == 1
                                                        else ""))
    if drawn:  # log scales and a legend of nothing warn
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.legend(fontsize=8 if len(lines) > 6 else None, ncol=2 if len(lines) > 10 else 1)
    axes.grid(True, which="both", alpha=0.3)
    processes = document.get("processes", 1)
    ranks = f"{document['ranks']} rank{'s' * (document['ranks'] != 1)}" + \
        (f" in {processes} processes" if processes > 1 else "")
    axes.set_title(f"distrib bench {document['collective']} ({document['type']}, {ranks})\n"
                   f"{document['device']}, {document['date'][:10]}", fontsize=10)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path
