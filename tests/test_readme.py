"""The README's "Use" snippet runs as printed (a fresh interpreter, no network)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_snippet(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_use_snippet_runs_as_printed(tmp_path):
    code = readme_snippet("Use")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "train_runtime" in result.stdout
