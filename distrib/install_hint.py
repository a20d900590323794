"""How to add an optional extra to this installation of distrib: from the clone it came from, else by name."""

from __future__ import annotations

import functools
import json
import pathlib
import urllib.parse
from importlib import metadata

_ROOT = pathlib.Path(__file__).resolve().parent.parent  # the folder holding the package (a clone, site-packages)


def pip_install(extra: str) -> str:
    """The command that adds `extra` (e.g. "train") to this installation.

    `pip install 'distrib[train]'` where distrib was installed by name; where it was installed from a clone
    (`pip install '.[train]'`, the README's way), that clone's path instead, since the name would ask the package
    index for whatever it holds under it.

    Example:
      >>> pip_install("ps").startswith("pip install ")
      True
    """
    source = _installed_from()
    if source is None:
        return f"pip install 'distrib[{extra}]'"
    folder, editable = source
    return f"pip install {'-e ' if editable else ''}'{folder}[{extra}]'"


@functools.cache
def _installed_from() -> tuple[str, bool] | None:
    """(the folder this distrib was installed from, whether editably), where that folder is a source tree that is
    still there; None otherwise (installed by name, from a wheel, or not installed at all)."""
    for dist in metadata.distributions(name="distrib"):
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except (OSError, ValueError):
            continue
        url = urllib.parse.urlparse(info.get("url", ""))
        if url.scheme != "file" or "dir_info" not in info:
            continue
        folder = pathlib.Path(urllib.parse.unquote(url.path))
        editable = bool(info["dir_info"].get("editable"))
        # the installation this module was imported from: an editable one runs from the folder itself, a copied
        # one from the site-packages its metadata lies in (several environments may hold one each)
        here = folder if editable else pathlib.Path(str(dist.locate_file("")))
        try:
            if here.resolve() == _ROOT and (folder / "pyproject.toml").is_file():
                return str(folder), editable
        except OSError:
            continue
    return None
