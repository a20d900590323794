"""Nested per-replica values of several dtypes that job.py reduces and gathers across processes, and the test in one."""

import numpy as np


def ragged_nested(rid):
    """Replica rid's leaves: float32, float16, int32 and bool, of rid + 1, rid or 4 - rid rows (whole numbers, so
    that sums grouped by process are exact)."""
    return {"f32": np.arange(3 * (rid + 1), dtype=np.float32).reshape(rid + 1, 3) + rid,
            "f16": [np.full((2, 2), rid, np.float16), np.full((rid, 1), rid, np.float16)],
            "i32": np.arange(rid, dtype=np.int32), "bool": np.array([rid % 2 == 0] * (4 - rid))}


def same_shaped(rid):
    """Replica rid's leaves of one shape on every replica, 0-d ones too."""
    return {"w": np.full((2, 2), rid, np.float32), "n": np.int32(rid), "h": np.float16(rid)}
