"""Messages about a missing extra give a command that installs it into this installation: the clone's path where
distrib was installed from a clone (the name would ask the package index for whatever it holds under it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

import distrib
from distrib.install_hint import pip_install
from support import ROOT, copy_source_tree

HINT = "from distrib.install_hint import pip_install; import distrib; print(distrib.__file__); print(pip_install('ps'))"


def test_a_copy_installed_from_a_folder_names_that_folder_while_it_is_there(tmp_path):
    source = copy_source_tree(tmp_path / "clone")
    # no build isolation: the installed setuptools builds it, so the test needs no index
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(tmp_path / "site"), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))

    def hint() -> list[str]:
        return subprocess.run([sys.executable, "-c", HINT], capture_output=True, text=True, check=True, env=env,
                              cwd=tmp_path).stdout.splitlines()

    assert hint() == [str(tmp_path / "site" / "distrib" / "__init__.py"), f"pip install '{source}[ps]'"]
    shutil.rmtree(source)  # the clone is gone: the name is all that is left to say
    assert hint()[1] == "pip install 'distrib[ps]'"


def test_the_installation_running_these_tests_gets_its_own_command():
    installed = [json.loads(dist.read_text("direct_url.json") or "{}")
                 for dist in metadata.distributions(name="distrib")]
    if not any(info.get("dir_info", {}).get("editable") and info.get("url") == ROOT.as_uri() for info in installed):
        pytest.skip("distrib is not installed editable from this clone here (the README's test command does that)")
    assert os.path.dirname(distrib.__file__) == str(ROOT / "distrib")
    assert pip_install("train") == f"pip install -e '{ROOT}[train]'"
