"""The README's examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def examples():
    text = README.read_text()
    return dict(re.findall(r"<!-- example: (\w+) -->\n```python\n(.*?)```", text, re.S))


NAMES = ["mooncake", "nixl", "pythonic", "notify", "sessions", "metrics"]


def test_readme_has_examples():
    assert set(examples()) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_readme_example_runs(name, tmp_path):
    script = tmp_path / f"{name}.py"
    script.write_text(examples()[name])
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
