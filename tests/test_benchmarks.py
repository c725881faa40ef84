"""The GPU benchmark suite's model stages run end to end on the CPU (a tiny model), so a broken stage shows here
and not in the device minutes of a GPU session."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_model_stages_on_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--model", "tiny", "--workloads", "swe:0.002",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert not [key for key in results if key.endswith("_error")], run.stdout[-3000:]
    stages = results["stages"]
    assert [s.split(":")[0] for s in stages] == ["parity", "kernels", "warmup", "cost_fit", "swe", "profile",
                                                 "padded"], stages
    assert "parity: not run on cpu" in stages and "kernels: not run on cpu" in stages
    row = results["workloads"]["swe@0.002"]
    for path in ("tree", "packed", "loop", "padded"):
        assert row[path]["seconds"] > 0, path
    assert row["stats"]["R_tok"] > 1 and row["S_phys"] > 1 and row["loop_model_seconds"] > 0
    assert results["warmup"]["loop_length_classes"] >= 1 and results["warmup"]["padded_shape_classes"] >= 1
    assert "| swe@0.002 |" in run.stdout
    assert row["baseline"] in ("packed", "loop", "padded") and row["tree_rate_vs_plain"] > 0
    families = results["profile"]["cpu_seconds_by_family"]
    assert set(families) == {"tree", "packed"} and all(sum(f.values()) > 0 for f in families.values())
    assert (tmp_path / "profile_tree.txt").read_text().count("\n") > 10
