"""Whether a path can name a file to write: the checks that checkpoints and timelines share, before any write."""

from __future__ import annotations

import os


def names_a_folder(path: str) -> bool:
    """Whether `path` ends in a separator or is an existing folder."""
    return path.endswith((os.sep, os.altsep or os.sep)) or os.path.isdir(path)


def file_in_the_way(path: str) -> str | None:
    """The file that stands where a folder of `path` must be (the nearest existing one, since the missing folders
    are made), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    return None if os.path.isdir(folder) else folder
