"""The stand-ins for Mooncake's and NIXL's packages travel in the kvmove
wheel; ``python -m kvmove.shims NAME`` prints the directory to put on
``PYTHONPATH``, and an unmodified client then gets kvmove (issue 16)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import test_mooncake_compat
import test_nixl_compat


@pytest.mark.parametrize(
    "name, client", [("mooncake", test_mooncake_compat.UNMODIFIED_CLIENT), ("nixl", test_nixl_compat.UNMODIFIED_CLIENT)]
)
def test_installed_shim_serves_an_unmodified_client(tmp_path, name, client):
    # From an empty directory: the installed kvmove, not the checkout.
    r = subprocess.run([sys.executable, "-m", "kvmove.shims", name], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    shim = Path(r.stdout.strip())
    assert (shim / name / "__init__.py").is_file()
    assert "site-packages" in shim.parts, f"{shim} is not the installed copy"
    env = dict(os.environ, MC_FORCE_TCP="1", PYTHONPATH=str(shim))
    env.pop("KVMOVE_PROTOCOL", None)
    out = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_shims_usage(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvmove.shims", "ucx"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr
