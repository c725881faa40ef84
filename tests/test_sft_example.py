"""examples/train_tree_sft.py end to end on CPU, as a user runs it: TreeSFTTrainer and (``--no-tree``) SFTTrainer
log the same loss per step on multi-turn conversations whose rows share turns, and the saved folder loads with
plain transformers."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_tree_sft.py"
LINE = re.compile(r"step +(\d+) +loss ([\d.]+) +token accuracy ([\d.]+) +R_tok ([\d.]+)")


def run(tmp_path, *extra) -> list[tuple[int, float, float, float]]:
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--output-dir", str(tmp_path), *extra],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [(int(s), float(loss), float(acc), float(r)) for s, loss, acc, r in LINE.findall(result.stdout)]
    assert [row[0] for row in rows] == [1, 2], result.stdout[-2000:]
    return rows


def test_tree_sft_example_matches_sft_trainer(tmp_path):
    tree = run(tmp_path / "tree")
    plain = run(tmp_path / "plain", "--no-tree")
    assert all(row[3] > 1.5 for row in tree)  # the rows share their system prompt and earlier turns
    for (_, loss, accuracy, _), (_, loss_plain, accuracy_plain, _) in zip(tree, plain):
        assert loss == pytest.approx(loss_plain, rel=1e-4) and accuracy == pytest.approx(accuracy_plain, abs=1e-3)
    check = ("from transformers import AutoModelForCausalLM; import sys; "
             "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); assert 'harts_hf' not in sys.modules")
    subprocess.run([sys.executable, "-c", check, str(tmp_path / "tree")], check=True, timeout=300)
