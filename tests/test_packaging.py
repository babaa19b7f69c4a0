"""cli/ and integrations/ install under the cachecraft namespace, never as top-level packages."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_namespaces():
    import cachecraft.cli.app
    import cachecraft.integrations

    assert Path(cachecraft.cli.app.__file__).resolve() == ROOT / "cli" / "app.py"
    assert Path(cachecraft.integrations.__file__).resolve() == ROOT / "integrations" / "__init__.py"


@pytest.mark.slow
def test_regular_install_has_no_top_level_cli_or_integrations(tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (target / "cachecraft" / "cli" / "app.py").is_file()
    assert (target / "cachecraft" / "integrations" / "__init__.py").is_file()
    assert not (target / "cli").exists() and not (target / "integrations").exists()
    check = subprocess.run([sys.executable, "-c", "import cachecraft.cli, cachecraft.integrations; "
                            "print(cachecraft.cli.__file__)"], capture_output=True, text=True,
                           cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert check.returncode == 0 and str(target) in check.stdout, check.stderr
