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


def test_the_python_the_readme_names_is_the_one_the_requirements_take():
    """The README's "Python 3.X+" is setup.cfg's python_requires, and TRL, the requirement pinned to one minor series
    (every 1.16.x), accepts that Python: TRL 1.16 needs 3.11, so a README saying 3.10+ sent 3.10 users into pip's
    resolution error. (Other requirements are open-ended: pip finds an older release for an older Python, so their
    installed release's Requires-Python, e.g. numpy 2.5's 3.12 in a 3.13 environment, says nothing here.)"""
    import configparser
    from importlib.metadata import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floor = config["options"]["python_requires"].strip()
    assert floor.startswith(">="), floor
    oldest = floor[2:]
    assert f"any Python {oldest}+ environment" in (ROOT / "README.md").read_text()
    pinned = [Requirement(line.strip()) for line in config["options"]["install_requires"].strip().splitlines()]
    trl = next(r for r in pinned if r.name == "trl")
    assert metadata("trl")["Version"] in trl.specifier
    needs = metadata("trl")["Requires-Python"]
    assert SpecifierSet(needs).contains(oldest), f"TRL {metadata('trl')['Version']} needs Python {needs}; " \
                                                 f"setup.cfg says {floor}"


def test_run_sh_refuses_an_older_python_naming_it_and_the_fix(tmp_path):
    """`PYTHON=<a 3.10> bash scripts/run.sh train` stops before installing anything, naming the interpreter, its
    version and what to do (pip's own refusal would come after resolving every requirement)."""
    fake = tmp_path / "python3.10"
    fake.write_text('#!/usr/bin/env bash\nif [ "$1" = "-V" ]; then echo "Python 3.10.13"; exit 0; fi\nexit 1\n')
    fake.chmod(0o755)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "run.sh"), "train"], env=dict(os.environ, PYTHON=str(fake)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"PYTHON={fake} is Python 3.10.13" in result.stderr and "3.11" in result.stderr
