"""What every benchmark's raw output records about its run: the command, the date, the machine and the versions."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

__all__ = ["TritonCompiles", "run_record", "write_run_record"]


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
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                host=platform.node(), python=platform.python_version(), device=device, versions=versions)


def write_run_record(out: Path) -> Path:
    """Write :func:`run_record` to ``out/run.json`` (next to the run's results); returns the path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.json"
    path.write_text(json.dumps(run_record(), indent=1))
    return path


class TritonCompiles:
    """Counts the Triton kernel specialisations a process builds (or loads from Triton's disk cache), through
    Triton's JIT hooks: :meth:`take` returns, since the last call, ``{"count", "seconds", "kernels"}`` (seconds
    between each pre- and post-compilation hook; an autotuner's benchmarking of the configurations is not counted,
    its compilations are). A run whose steps keep compiling shows it here rather than as unexplained seconds. Does
    nothing where Triton (or its ``knobs`` module, Triton >= 3.3) is absent."""

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        self._open: dict[int, float] = {}
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no Triton here: nothing compiles
            return
        import time

        def before(*, fn, key, **unused):
            self._open[id(key)] = time.perf_counter()
            return False  # False: go on and compile

        def after(*, fn, key, **unused):
            start = self._open.pop(id(key), None)
            self.events.append((f"{fn.module}.{fn.name}", time.perf_counter() - start if start else 0.0))

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after

    def take(self) -> dict:
        events, self.events = self.events, []
        kernels: dict[str, int] = {}
        for name, _ in events:
            kernels[name] = kernels.get(name, 0) + 1
        return dict(count=len(events), seconds=round(sum(s for _, s in events), 2),
                    kernels=dict(sorted(kernels.items(), key=lambda item: -item[1])))
