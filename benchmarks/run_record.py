"""What every benchmark's raw output records about its run: the command, the date, the machine and the versions."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

__all__ = ["run_record", "write_run_record"]


def run_record() -> dict:
    """The command line, UTC time, host, Python, torch, CUDA device and library versions of this process."""
    import torch

    versions = {}
    for name in ("torch", "transformers", "trl", "fla", "triton", "harts_hf"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except Exception:  # noqa: BLE001 - absent or unimportable here: recorded as such
                versions[name] = None
                continue
        versions[name] = getattr(module, "__version__", None)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return dict(command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host=platform.node(), python=platform.python_version(), device=device, versions=versions)


def write_run_record(out: Path) -> Path:
    """Write :func:`run_record` to ``out/run.json`` (next to the run's results); returns the path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.json"
    path.write_text(json.dumps(run_record(), indent=1))
    return path
