"""What a fresh install needs: the test suite collects where CuPy is absent (its GPU modules skip)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_tests_collect_where_cupy_is_absent():
    # sys.modules["cupy"] = None makes `import cupy` fail as it does where CuPy is not installed
    code = ("import sys; sys.modules['cupy'] = None; import pytest; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " collected" in result.stdout and "error" not in result.stdout.splitlines()[-1]
