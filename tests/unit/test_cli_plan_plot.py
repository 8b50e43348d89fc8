"""`elastic-refit plan ... --plot FILE.png|svg`: the picture is written, its matrix holds the
plan's bytes, and what cannot be drawn is one error line naming the fix."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from elastic_refit.cli import main
from elastic_refit.cli.plan_plot import domain_matrix

CASE = ["plan", "--model", "qwen3-30b-a3b", "--layers", "1", "--source", "tp=2,pp=2,ep=2", "--destination",
        "tp=4,dp=2", "--domain-size", "4"]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_is_written(tmp_path, capsys, suffix):
    out = tmp_path / f"plan{suffix}"
    assert main([*CASE, "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    assert f"plot written to {out}" in capsys.readouterr().err


def test_the_domain_matrix_holds_the_plan_s_bytes():
    from elastic_refit.layout.refit import model_refit_spec
    from elastic_refit.plan import make_plan

    spec = model_refit_spec("qwen3-30b-a3b", "tp=2,pp=2,ep=2", "tp=4,dp=2", domain_size=4, num_layers=1)
    plan = make_plan(spec.source, spec.destination, spec.topology)
    matrix = domain_matrix(plan)
    off_diagonal = matrix.sum() - np.trace(matrix)
    assert off_diagonal == plan.stats.cross_domain_bytes
    assert np.trace(matrix) == plan.stats.intra_domain_bytes + plan.stats.local_bytes


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert main([*CASE, "--plot", str(tmp_path / "plan.pdf")]) == 2
    assert "--plot takes a .png or .svg file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main([*CASE, "--plot", str(tmp_path / "plan.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'elastic-refit[plot]'" in err and not (tmp_path / "plan.png").exists()
