"""Every --help lists its choices (presets, clusters, formats), and a usage line never shows
an optional argument as required (bench's TARGET)."""

from __future__ import annotations

import pytest

from elastic_refit.cli import main
from elastic_refit.layout.formats import FORMAT_NAMES
from elastic_refit.layout.models import MODELS
from elastic_refit.plan.cost import CLUSTERS


def _help(capsys, *command: str) -> str:
    assert main([*command, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


@pytest.mark.parametrize("command", [("plan",), ("bench",)])
def test_plan_and_bench_help_list_every_preset_and_format(capsys, command):
    text = _help(capsys, *command)
    for name in (*MODELS, *FORMAT_NAMES):
        assert name in text, (command, name)
    if command == ("plan",):
        for name in CLUSTERS:
            assert name in text, name


def test_bench_usage_shows_its_target_as_optional(capsys):
    text = _help(capsys, "bench")
    usage = text[:text.index("Without a TARGET")]
    assert "[TARGET]" in usage and " TARGET ..." not in usage.replace("[TARGET]", "")
    for target in ("membership", "soak", "control-plane"):
        assert target in text


def test_top_level_help_lists_the_etcd_command(capsys):
    text = _help(capsys)
    assert "etcd" in text and "run a local etcd for development" in text
