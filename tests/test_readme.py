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
    """The README's "Python 3.X+" is setup.cfg's python_requires, and no requirement installed here asks for a newer
    Python than that (TRL 1.16 and transformers >= 5.21 need 3.11: a 3.10 user would get pip's resolution error
    for an environment the README promised)."""
    import configparser
    from importlib.metadata import PackageNotFoundError, metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floor = config["options"]["python_requires"].strip()
    assert floor.startswith(">="), floor
    oldest = floor[2:]
    assert f"any Python {oldest}+ environment" in (ROOT / "README.md").read_text()
    for line in config["options"]["install_requires"].strip().splitlines():
        name = Requirement(line.strip()).name
        try:
            needs = metadata(name).get("Requires-Python")
        except PackageNotFoundError:
            continue
        if needs:
            assert SpecifierSet(needs).contains(oldest), f"{name} needs Python {needs}; setup.cfg says {floor}"


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
