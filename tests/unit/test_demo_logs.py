"""The demo keeps its member logs where it says they are (chaos/demo.py ``_logs_into``): a
fresh folder (``--log-dir``, or the temporary one it makes) holds them itself, not one folder
deeper; a folder that holds an earlier run's logs keeps this run's in a folder of their own."""

from __future__ import annotations

from elastic_refit.chaos.demo import _logs_into


def _trial(root, name="chaos-0-abc123"):
    trial = root / name
    trial.mkdir(parents=True)
    (trial / "t0-L0-aaaa.log").write_text("{}\n")
    (trial / "faults.jsonl").write_text("")
    return trial


def test_a_fresh_folder_holds_the_logs_itself(tmp_path):
    root = tmp_path / "logs"
    trial = _trial(root)
    assert _logs_into(root, str(trial), fresh=True) == str(root)
    assert sorted(p.name for p in root.iterdir()) == ["faults.jsonl", "t0-L0-aaaa.log"]


def test_a_folder_with_an_earlier_run_keeps_this_one_apart(tmp_path):
    root = tmp_path / "logs"
    trial = _trial(root)
    (root / "t0-L0-old0.log").write_text("{}\n")
    assert _logs_into(root, str(trial), fresh=False) == str(trial)
    assert (trial / "t0-L0-aaaa.log").exists() and (root / "t0-L0-old0.log").exists()


def test_without_a_trial_the_root_is_named(tmp_path):
    assert _logs_into(tmp_path, None, fresh=True) == str(tmp_path)
