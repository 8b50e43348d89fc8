"""The wheel claims one top-level import name, ``elastic_refit``: the folders membership/,
kernels/ and chaos/ install under it, so installing it never clobbers PyPI's packages of
those names (``kernels`` is the hub-kernels package transformers loads)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_wheel_top_level_names_are_elastic_refit_only(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(REPO_ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("elastic_refit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"elastic_refit"}, tops
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["elastic_refit"]
    for package in ("kernels", "membership", "chaos", "testing", "transport", "runtime", "plan", "layout", "cli"):
        assert f"elastic_refit/{package}/__init__.py" in names, package
    assert "elastic_refit/layout/configs/deepseek-v3.json" in names  # package data travels too


def test_the_sibling_folders_import_under_elastic_refit():
    import elastic_refit.chaos
    import elastic_refit.kernels
    import elastic_refit.membership

    for module, folder in ((elastic_refit.kernels, "kernels"), (elastic_refit.membership, "membership"),
                           (elastic_refit.chaos, "chaos")):
        # editable: the repository's folder; installed: elastic_refit/<folder> in site-packages
        assert module.__name__ == f"elastic_refit.{folder}"
        assert Path(module.__file__).resolve().parent.name == folder


def test_building_the_project_prints_no_packaging_warning(tmp_path):
    """`pip install -e .` / `pip wheel .` show nothing from our packaging configuration (a
    deprecated license table and a data folder setuptools did not know were both printed)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path), str(REPO_ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # distutils says byte-compiling is off when PYTHONDONTWRITEBYTECODE is set: the caller's
    # environment, not our configuration
    warnings = [line.strip() for line in (proc.stdout + proc.stderr).splitlines()
                if ("warning" in line.lower() or "deprecat" in line.lower()) and "byte-compiling is disabled" not in line
                and "Location 'file:" not in line]
    assert not warnings, "\n".join(warnings[:20])
