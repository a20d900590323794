"""Records TensorFlow's result for each conformance case in expected/<NAME>.json (run it with TensorFlow installed).

Usage (from the repository root, in an environment with tensorflow-cpu and numpy; distrib is not needed):

    python tests/conformance/record.py                 # record every case
    python tests/conformance/record.py NAME ...        # record these cases
    python tests/conformance/record.py --check [NAME]  # compare with the files, write nothing; exit 1 on a difference

Each case's `run_distrib(distrib, np)` is called with the namespace of tensorflow_namespace.py as `distrib`:
MirroredStrategy on 4 logical CPU devices, run eagerly. Each case runs in a process of its own: TensorFlow numbers
its collectives per strategy, so two strategies' all_gathers in one process collide. The layout of the files is
described in README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
BUILTIN_BASES = (ValueError, TypeError, RuntimeError, NotImplementedError)


def as_record(value):
    """A returned structure in the JSON layout: dicts stay dicts, sequences become lists, leaves become arrays."""
    if isinstance(value, dict):
        return {str(k): as_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_record(v) for v in value]
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        array = np.asarray(value, np.bool_)
    elif isinstance(value, int):
        array = np.asarray(value, np.int64)
    else:
        array = np.asarray(value)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "array": array.tolist()}


def run_case(path: pathlib.Path, namespace) -> dict:
    """The case's record: its result, or the exception TensorFlow raised (for the error_* cases)."""
    spec = importlib.util.spec_from_file_location(f"conformance_{path.stem}", path)
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    try:
        result = as_record(case.run_distrib(namespace, np))
    except Exception as exc:  # noqa: BLE001 - the exception is the result being recorded
        if not path.stem.startswith("error_"):
            raise
        base = next((b.__name__ for b in type(exc).__mro__ if b in BUILTIN_BASES), None)
        result = {"error": type(exc).__name__, "base": base}
    else:
        if path.stem.startswith("error_"):
            raise RuntimeError(f"{path.stem}: TensorFlow raised nothing, but the case is named error_*")
    return {"name": case.NAME, "description": case.DESCRIPTION, "result": result}


def dumps(record: dict) -> str:
    """The record as JSON with two-space indents and each array leaf on one line, as the files are kept."""
    def text(value, indent):
        pad, inner = " " * indent, " " * (indent + 2)
        if isinstance(value, dict) and value and not ({"dtype", "shape", "array"} == set(value) or "error" in value):
            items = [f"{inner}{json.dumps(k)}: {text(v, indent + 2)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(value, list) and value:
            return "[\n" + ",\n".join(inner + text(v, indent + 2) for v in value) + f"\n{pad}]"
        return json.dumps(value)
    return text(record, 0) + "\n"


def record_in_subprocess(path: pathlib.Path) -> dict:
    """The case's record, from a fresh Python process running this script with --case."""
    done = subprocess.run([sys.executable, __file__, "--case", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{path.stem}: recording failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="cases to record (default: all)")
    parser.add_argument("--check", action="store_true", help="compare with expected/, write nothing")
    parser.add_argument("--expected", type=pathlib.Path, default=HERE / "expected", help="folder of the records")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cases recorded at once")
    parser.add_argument("--case", type=pathlib.Path, help=argparse.SUPPRESS)  # one case, its record to stdout
    args = parser.parse_args(argv)

    if args.case:
        import tensorflow as tf
        from tensorflow_namespace import build

        record = run_case(args.case, build(tf))
        print(json.dumps({"name": record["name"], "description": record["description"],
                          "tensorflow": tf.__version__, "result": record["result"]}))
        return 0
    paths = sorted((HERE / "cases").glob("*.py"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names]
    differences = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for path, record in zip(paths, pool.map(record_in_subprocess, paths)):
            target = args.expected / f"{path.stem}.json"
            if args.check:
                kept = json.loads(target.read_text())["result"] if target.exists() else None
                same = kept == record["result"]
                differences += not same
                print(f"{'same' if same else 'DIFFERENT'}  {path.stem}", flush=True)
                if not same:
                    print(f"  recorded: {json.dumps(record['result'])}\n  kept:     {json.dumps(kept)}")
            else:
                target.write_text(dumps(record))
                print(f"recorded  {path.stem}", flush=True)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
