"""The delta codec's warm-up (transport.delta_warm): on a CPU nothing to load; the run it
makes on a GPU (here forced vectorized on the CPU) codes, checks and writes every geometry,
and a codec that gives a wrong byte fails it loudly instead of warming."""

from __future__ import annotations

import pytest
import torch

from elastic_refit.transport import delta_warm
from elastic_refit.transport.delta_boxes import Boxes, Written


def test_a_cpu_needs_no_warming():
    assert delta_warm.warm_up("cpu") == 0


@pytest.mark.parametrize("vectorized", [True, False])
def test_the_run_codes_checks_and_writes_every_geometry(vectorized):
    assert delta_warm.exercise(torch.device("cpu"), vectorized=vectorized) == 4


def test_a_codec_that_writes_nothing_fails_the_warm_up(monkeypatch):
    def nothing_written(self, tensors, seg, verify):
        moves = seg.moves.clone()  # the moves check passes; the bytes never land
        return moves, Written()

    monkeypatch.setattr(Boxes, "apply_segments", nothing_written)
    with pytest.raises(RuntimeError, match=r"the delta codec gave wrong bytes on cpu \(bfloat16, box \(8, 64\)\)"):
        delta_warm.exercise(torch.device("cpu"), vectorized=True)
