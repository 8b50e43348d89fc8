"""`elastic-refit plan`: the JSON keys the issue promises, the human table, and bad input
(one `elastic-refit: error:` line, exit status 2, no traceback), in-process and as a real
subprocess of the installed console script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_refit import cli
from elastic_refit.cli import plan_cmd
from elastic_refit.layout import LayoutBuilder, RefitSpec, Topology, add_sharded_tensor

# The console script installed next to this interpreter (`pip install -e .`).
SCRIPT = Path(sys.executable).parent / "elastic-refit"

REQUIRED_KEYS = {
    "model_bytes", "dst_bytes", "lower_bound_bytes", "cross_domain_bytes", "intra_domain_bytes",
    "gather_broadcast_bytes", "max_send_bytes", "max_recv_bytes", "num_transfers", "plan_seconds",
    "fingerprint",
}
CLUSTER_KEYS = {"predicted_seconds", "bound_seconds"}

SPEC = {
    "domain_size": 2,
    "tensors": [
        # Replicated source (2 replicas of a row split) -> columns split over 4 ranks in
        # torch.chunk sizes 2, 2, 2, 0 (rank 7's shard is empty).
        {"name": "w", "shape": [10, 6], "dtype": "bfloat16",
         "source": {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]},
         "destination": {"mesh": [4, 5, 6, 7], "placements": ["S(1)"]}},
        # Colocated: rank 1 holds part of both sides.
        {"name": "b", "shape": [7], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [[1, 5], [6, 7]], "placements": ["R", "S(0)"]}},
    ],
}


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "refit.json"
    path.write_text(json.dumps(SPEC))
    return path


def run_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """``cli.main(argv)`` with capsys; returns (exit status, stdout, stderr)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_spec_json_has_every_promised_key(capsys, spec_file):
    code, out, _ = run_in_process(capsys, "plan", "--spec", str(spec_file), "--json")
    assert code == 0
    figures = json.loads(out)  # one object, nothing else on stdout
    assert figures.keys() >= REQUIRED_KEYS
    assert not CLUSTER_KEYS & figures.keys()  # only with --cluster
    assert figures["cross_domain_bytes"] == figures["lower_bound_bytes"] > 0
    # w: 120 bytes, b: 28 bytes; destination holds b twice (replicated over mesh axis 0).
    assert figures["model_bytes"] == 10 * 6 * 2 + 7 * 4
    assert figures["dst_bytes"] == 10 * 6 * 2 + 2 * 7 * 4
    assert figures["gather_broadcast_bytes"] > figures["lower_bound_bytes"]
    assert figures["num_transfers"] >= 1 and figures["plan_seconds"] >= 0
    assert len(figures["fingerprint"]) == 32


def test_json_keys_follow_the_vocabulary(capsys, spec_file):
    # Counts are num_*, byte figures *_bytes, time figures *_seconds (DESIGN.md, vocabulary).
    code, out, _ = run_in_process(capsys, "plan", "--spec", str(spec_file), "--json", "--cluster", "h100-dgx")
    assert code == 0
    figures = json.loads(out)
    other = {key for key in figures
             if not (key.startswith("num_") or key.endswith(("_bytes", "_seconds")))}
    assert other == {"fingerprint", "cluster"}
    assert all(isinstance(figures[key], int) for key in figures if key.startswith("num_"))


def test_spec_json_with_cluster_adds_prediction(capsys, spec_file):
    code, out, _ = run_in_process(capsys, "plan", "--spec", str(spec_file), "--json", "--cluster", "h100-dgx")
    assert code == 0
    figures = json.loads(out)
    assert figures.keys() >= (REQUIRED_KEYS | CLUSTER_KEYS)
    assert figures["predicted_seconds"] >= figures["bound_seconds"] > 0


def test_human_table_prints_figures_and_fingerprint(capsys, spec_file):
    code, out, err = run_in_process(capsys, "plan", "--spec", str(spec_file), "--cluster", "gb200-nvl72")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"spec {spec_file}") and "4 source ranks" in lines[0]
    assert lines[1].split() == ["figure", "value", "ratio", "/", "note"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    rows = {line.split("  ")[0].strip(): line for line in lines[3:]}
    assert rows["planned cross-domain"].rstrip().endswith("1.000")
    assert "predicted on gb200-nvl72" in rows and "bound" in rows["predicted on gb200-nvl72"]
    assert lines[-1].startswith("fingerprint ")
    # Same plan as the JSON run: the fingerprint is a pure function of the inputs.
    _, js, _ = run_in_process(capsys, "plan", "--spec", str(spec_file), "--json")
    assert lines[-1] == f"fingerprint {json.loads(js)['fingerprint']}"
    assert "building layouts" in err  # progress goes to stderr, not into the table


def test_model_preset_json(capsys):
    code, out, _ = run_in_process(capsys, "plan", "--model", "llama-3.1-8b", "--source", "tp=2,pp=2,dp=2",
                                  "--destination", "tp=4,dp=2", "--layers", "2", "--json")
    assert code == 0
    figures = json.loads(out)
    assert figures.keys() >= REQUIRED_KEYS
    assert figures["cross_domain_bytes"] == figures["lower_bound_bytes"] > 0
    assert figures["num_source_ranks"] == 8 and figures["num_destination_ranks"] == 8
    # Two full layers, embeddings and head of Llama-3.1-8B in bf16: between 1 and 3 GB.
    assert 1e9 < figures["model_bytes"] < 3e9
    # Two inference replicas each hold the whole model (tp=4 splits, dp=2 replicates).
    assert figures["dst_bytes"] >= 2 * figures["model_bytes"]


def test_subprocess_console_script(spec_file):
    """The real entry point, as a user runs it."""
    assert SCRIPT.exists(), f"console script missing at {SCRIPT}"
    ok = subprocess.run([str(SCRIPT), "plan", "--spec", str(spec_file), "--json", "--cluster", "h100-dgx"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    figures = json.loads(ok.stdout)
    assert figures.keys() >= (REQUIRED_KEYS | CLUSTER_KEYS)
    assert figures["cross_domain_bytes"] == figures["lower_bound_bytes"]
    bad = subprocess.run([str(SCRIPT), "plan", "--spec", str(spec_file.with_name("missing.json")), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [f"elastic-refit: error: spec file {str(spec_file.with_name('missing.json'))!r} does not exist"]
    assert "Traceback" not in bad.stderr + bad.stdout


def test_python_dash_m_entry_point(spec_file):
    done = subprocess.run([sys.executable, "-m", "elastic_refit.cli", "plan", "--spec", str(spec_file), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout).keys() >= REQUIRED_KEYS


def test_json_output_follows_redirected_stdout(spec_file):
    import contextlib
    import io

    first, second = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(first):
        assert cli.main(["plan", "--spec", str(spec_file), "--json"]) == 0
    first.close()  # e.g. the capture of an earlier test, or a finished log file
    with contextlib.redirect_stdout(second):
        code = cli.main(["plan", "--spec", str(spec_file), "--json"])
    assert code == 0
    assert second.getvalue(), "the JSON went to the stdout of the first import, not the live one"
    assert json.loads(second.getvalue())["cross_domain_bytes"] > 0


# ---- bad input --------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _mismatched_shapes(tmp_path: Path) -> list[str]:
    """The same tensor declared twice with different shapes (the only way a spec file can
    give one tensor two shapes)."""
    second = dict(SPEC["tensors"][0], shape=[10, 7])
    return ["--spec", _write(tmp_path, "shapes.json", json.dumps(dict(SPEC, tensors=[SPEC["tensors"][0], second])))]


BAD_INPUTS = {
    "missing file": (lambda tmp: ["--spec", str(tmp / "nope.json")], r"spec file '.*nope\.json' does not exist"),
    "malformed json": (lambda tmp: ["--spec", _write(tmp, "bad.json", '{"tensors": [\n  {"name": 1,}\n]}')],
                       r"bad\.json: malformed JSON at line 2 column \d+"),
    "unknown model": (lambda tmp: ["--model", "gpt-7", "--source", "tp=2", "--destination", "tp=2"],
                      r"unknown model 'gpt-7'"),
    "bad parallelism value": (lambda tmp: ["--model", "llama-3.1-8b", "--source", "tp=two", "--destination", "tp=2"],
                              r"tp='two'.*not an integer"),
    "bad parallelism key": (lambda tmp: ["--model", "llama-3.1-8b", "--source", "tp=2", "--destination", "tp=2,xp=3"],
                            r"unknown parallelism key 'xp'"),
    "missing destination": (lambda tmp: ["--model", "llama-3.1-8b", "--source", "tp=2"],
                            r"--model needs --source and --destination"),
    "mismatched spec shapes": (_mismatched_shapes, r"tensor 'w'.*\(10, 6\).*\(10, 7\)"),
    "overlapping destination buffers": (
        lambda tmp: ["--spec", _write(tmp, "overlap.json", json.dumps(dict(SPEC, tensors=[
            SPEC["tensors"][0], dict(SPEC["tensors"][0], source={"mesh": [8], "placements": ["R"]},
                                          destination={"mesh": [7, 9], "placements": ["R"]})])))],
        r"buffer 'w' declared twice on rank 7"),
    "domain size 0": (lambda tmp: ["--model", "llama-3.1-8b", "--source", "tp=2", "--destination", "tp=2",
                                   "--domain-size", "0"], r"^elastic-refit: error: --domain-size must be >= 1, got 0$"),
    "layers 0": (lambda tmp: ["--model", "llama-3.1-8b", "--source", "tp=2", "--destination", "tp=2",
                              "--layers", "0"], r"^elastic-refit: error: --layers must be >= 1, got 0$"),
    "spec is a directory": (lambda tmp: ["--spec", str(tmp)], r"spec file '.*' is a directory$"),
    "deeply nested json": (lambda tmp: ["--spec", _write(tmp, "deep.json", "[" * 100_000 + "]" * 100_000)],
                           r"deep\.json: JSON nested too deeply to read$"),
    "usage error": (lambda tmp: ["--spec"], r"^elastic-refit: error: plan: argument --spec: expected one argument "
                                            r"\(see --help\)$"),
    "element count overflow": (
        lambda tmp: ["--spec", _write(tmp, "huge.json", json.dumps(dict(SPEC, tensors=[
            dict(SPEC["tensors"][0], shape=[2**40, 2**40])])))],
        r"^elastic-refit: error: .*huge\.json: tensor 'w' source: \[1099511627776, 1099511627776\] bfloat16 is "
        r"2417851639229258349412352 bytes, more than "
        r"the 4611686018427387904 \(2\*\*62\) a layout can address$"),
    "rank id too large": (
        lambda tmp: ["--spec", _write(tmp, "rank.json", json.dumps({"tensors": [
            dict(SPEC["tensors"][0], destination={"mesh": [10**9], "placements": ["R"]})]}))],
        r"tensor 'w' destination: rank ids must be in \[0, 1048576\), got 1000000000$"),
    "bucket size": (lambda tmp: ["--model", "llama-3.1-8b", "--source", "tp=2", "--destination", "tp=2",
                                 "--layers", "1", "--bucket-mib", "0"], r"--bucket-mib must be >= 1, got 0"),
}


@pytest.mark.parametrize("json_flag", [True, False], ids=["json", "table"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_error_line(capsys, tmp_path, case, json_flag):
    make_args, pattern = BAD_INPUTS[case]
    argv = ["plan", *make_args(tmp_path)] + (["--json"] if json_flag else [])
    code, out, err = run_in_process(capsys, *argv)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("elastic-refit: error: ")]
    assert len(errors) == 1, err
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in out + err
    if json_flag:
        assert err.splitlines() == errors and out == ""  # nothing but the error line


def _partial_source_spec() -> RefitSpec:
    """A destination that no source piece covers (rows 6..9 of w exist only on the
    destination). Spec files and presets always cover whole tensors, so this one is built
    with the layout API and handed to the CLI through its spec loader."""
    src, dst = LayoutBuilder(), LayoutBuilder()
    t = src.tensor("w", (10, 6), "float32")
    ids = src.buffers("w", [0], (6, 6), "float32")
    src.pieces(t, ids, [[0, 0]], [[6, 6]], [[0, 0]])
    add_sharded_tensor(dst, "w", (10, 6), "float32", [2, 3], ["S(0)"])
    return RefitSpec(src.build(), dst.build(), Topology.uniform(4, 2))


def _mismatched_sides_spec() -> RefitSpec:
    src, dst = LayoutBuilder(), LayoutBuilder()
    add_sharded_tensor(src, "w", (10, 6), "float32", [0], ["R"])
    add_sharded_tensor(dst, "w", (10, 6), "int32", [2], ["R"])  # (a float dtype would be a cast)
    return RefitSpec(src.build(), dst.build(), Topology.uniform(4, 2))


@pytest.mark.parametrize(("make", "pattern"), [
    (_partial_source_spec, r"tensor 'w': destination box \[5:10, 0:6\] on ranks 3 is not covered by any source "
                           r"piece \(6 of 30 elements covered\)"),
    (_mismatched_sides_spec, r"tensor 'w': source is \[10, 6\] float32, destination is \[10, 6\] int32; a refit casts between "
                             r"floating dtypes only \(.*\)"),
])
def test_planner_errors_reach_the_cli_as_one_line(capsys, monkeypatch, tmp_path, make, pattern):
    monkeypatch.setattr(plan_cmd, "load_spec", lambda path: make())
    code, out, err = run_in_process(capsys, "plan", "--spec", str(tmp_path / "any.json"), "--json")
    assert code == 2
    assert len(err.splitlines()) == 1 and out == ""
    assert re.fullmatch(rf"elastic-refit: error: {pattern}", err.strip()), err


# ---- --destination-format (issue 18 part 2) ---------------------------------------------------

def test_destination_format_plans_fp8_beside_bf16(capsys):
    code, out, _ = run_in_process(capsys, "plan", "--model", "deepseek-v3", "--source", "pp=2,dp=2,ep=2",
                                  "--destination", "tp=4", "--layers", "2", "--destination-format", "fp8-block128",
                                  "--cluster", "h100-dgx", "--domain-size", "4", "--json")
    assert code == 0
    f = json.loads(out)
    assert f["destination_format"] == "fp8-block128" and f["num_quantized_tensors"] > 0
    assert f["cross_domain_bytes"] == f["lower_bound_bytes"] > 0
    assert f["bf16_cross_domain_bytes"] == f["bf16_lower_bound_bytes"]
    # attention, MLP and expert weights quantized (scales included), norms, router, embeddings and
    # head not (two layers of DeepSeek-V3 beside its embeddings and head: ~0.81)
    assert 0.5 < f["cross_domain_bytes"] / f["bf16_cross_domain_bytes"] < 0.9
    assert f["predicted_seconds"] < f["bf16_predicted_seconds"] and f["bound_seconds"] < f["bf16_bound_seconds"]
    # the vocabulary: besides the format name, only num_*, *_bytes, *_seconds
    other = {k for k in f if not (k.startswith("num_") or k.endswith(("_bytes", "_seconds")))}
    assert other == {"fingerprint", "cluster", "destination_format"}
    # bf16 (the default for a preset) plans as before: same fingerprint, no FP8 keys
    _, plain, _ = run_in_process(capsys, "plan", "--model", "deepseek-v3", "--source", "pp=2,dp=2,ep=2",
                                 "--destination", "tp=4", "--layers", "2", "--domain-size", "4", "--json")
    _, explicit, _ = run_in_process(capsys, "plan", "--model", "deepseek-v3", "--source", "pp=2,dp=2,ep=2",
                                    "--destination", "tp=4", "--layers", "2", "--destination-format", "bf16",
                                    "--domain-size", "4", "--json")
    assert json.loads(plain)["fingerprint"] == json.loads(explicit)["fingerprint"] != f["fingerprint"]
    assert "destination_format" not in json.loads(plain)
    assert json.loads(plain)["cross_domain_bytes"] == f["bf16_cross_domain_bytes"]


def test_destination_format_of_a_spec_file(capsys, tmp_path):
    spec = json.loads(json.dumps(SPEC))
    spec["tensors"][0]["destination"]["format"] = "fp8-block16"
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(spec))
    _, declared, _ = run_in_process(capsys, "plan", "--spec", str(path), "--json")
    declared = json.loads(declared)
    assert declared["destination_format"] == "fp8-block16" and declared["num_quantized_tensors"] == 1
    # the flag overrides the spec's quantized tensors; bf16 quantizes none
    _, mx, _ = run_in_process(capsys, "plan", "--spec", str(path), "--json", "--destination-format", "mxfp8")
    assert json.loads(mx)["destination_format"] == "mxfp8"
    _, none, _ = run_in_process(capsys, "plan", "--spec", str(path), "--json", "--destination-format", "bf16")
    assert "destination_format" not in json.loads(none)
    # a spec without formats: the flag quantizes its matrices ("w"; not the vector "b")
    path.with_name("plain.json").write_text(json.dumps(SPEC))
    _, flagged, _ = run_in_process(capsys, "plan", "--spec", str(path.with_name("plain.json")), "--json",
                                   "--destination-format", "fp8-block16")
    assert json.loads(flagged)["num_quantized_tensors"] == 1
    # the human table shows the comparison
    code, out, _ = run_in_process(capsys, "plan", "--spec", str(path), "--cluster", "h100-dgx")
    assert code == 0 and "bf16 plan, cross-domain" in out and "destination formats" in out


@pytest.mark.parametrize("value", ["fp4", "", "fp8-block100"])
def test_bad_destination_format_is_one_error_line(capsys, spec_file, value):
    code, out, err = run_in_process(capsys, "plan", "--spec", str(spec_file), "--destination-format", value)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"elastic-refit: error: --destination-format must be one of bf16, fp8-block128, "
                                f"mxfp8, got {value!r}"]
