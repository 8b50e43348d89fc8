"""The cost model's deltas (``plan.cost.predict_delta``) and ``plan --delta-density``."""

from __future__ import annotations

import json

import pytest

from elastic_refit import cli
from elastic_refit.plan.cost import delta_fraction, get_cluster, predict, predict_delta
from elastic_refit.testing.world import RefitCase

CASE = dict(model="llama-3.1-8b", source="tp=2,pp=2", destination="tp=2,dp=2", num_layers=2, domain_size=2)


def test_delta_fraction_follows_the_coding():
    assert delta_fraction(0.0) == pytest.approx(1 / 510)
    assert delta_fraction(0.02) == pytest.approx(0.03 + 1 / 510)
    assert delta_fraction(0.02, itemsize=1) == pytest.approx(0.04 + 1 / 255)
    assert delta_fraction(1.0) == 1.0  # never above the bytes themselves
    with pytest.raises(ValueError):
        delta_fraction(1.5)


def test_deltas_are_predicted_faster_at_low_density_also_when_relayed():
    cluster = get_cluster("h100-dgx")
    plan = RefitCase(**CASE, relay="off").plan()
    low, high = predict_delta(plan, cluster, 0.01), predict_delta(plan, cluster, 0.5)
    assert low.wire_bytes < high.wire_bytes <= plan.stats.cross_domain_bytes
    assert low.network_seconds < high.network_seconds <= predict(plan, cluster).network_seconds
    relayed = RefitCase(**CASE, relay="on").plan()
    assert relayed.relayed
    coded = predict_delta(relayed, cluster, 0.01)  # relays forward the deltas' segments
    assert coded.fraction < 0.05 and coded.seconds < predict(relayed, cluster).seconds


def test_plan_delta_density_cli(capsys):
    args = ["plan", "--model", "llama-3.1-8b", "--layers", "2", "--source", "tp=2,pp=2", "--destination", "tp=2,dp=2",
            "--cluster", "h100-dgx", "--relay", "off", "--json", "--delta-density", "0.02,0.1"]
    assert cli.main(args) == 0
    figures = json.loads(capsys.readouterr().out)
    assert [d["density"] for d in figures["deltas"]] == [0.02, 0.1]
    assert figures["deltas"][0]["wire_fraction"] < figures["deltas"][1]["wire_fraction"]
    assert figures["deltas"][0]["predicted_seconds"] <= figures["deltas"][1]["predicted_seconds"]
    no_cluster = [a for a in args if a not in ("--cluster", "h100-dgx")]
    assert cli.main(no_cluster) != 0  # needs --cluster
    assert "--cluster" in capsys.readouterr().err
