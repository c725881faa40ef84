"""Triton's autotuning choices, carried from one device machine to the next.

A fresh device machine spends most of its first benchmark run compiling: every autotuned Triton kernel (fla's, and
harts_hf's own) is compiled and timed in each of its configurations before the best one runs (261.6 s before the first
Nemotron-H tree run on an H100, 2026-12-06; 503 s for Ling 3's on an H200, 2026-12-05). With its autotuning cache on
(``TRITON_CACHE_AUTOTUNING=1``; fla turns it on for its kernels), Triton writes each choice to
``<cache>/<key>/<kernel>.autotune.json``, where ``<key>`` hashes only content: Triton's own build, the compiler's
version and target architecture, the kernel's source, the configurations and the tuning key (the arguments named by
the kernel's ``key``). The same software on the same kind of card therefore looks for the same file, and finding it,
compiles the chosen configuration alone instead of timing them all.

``save DIR`` writes the choices found in the cache to ``DIR/<card>.json`` (one file per kind of card, merged with what
is there; only the chosen configuration of each is kept), and ``restore DIR`` puts the file of this machine's card back
into the cache, never over a file the cache already has. ``scripts/device_env.sh`` restores from
``scripts/autotune/`` at the start of every call and saves into the call's results in ``finish``; copying a call's
``autotune/<card>.json`` into ``scripts/autotune/`` carries them to later sessions. A choice made on another machine of
the same kind may differ from the one that machine would time anew (timings vary from run to run); nothing else about
the kernels changes. Set ``HARTS_AUTOTUNE_RESTORE=0`` to time every configuration afresh.

    python3 scripts/triton_autotune.py save OUT/autotune [--card NAME] [--cache DIR]
    python3 scripts/triton_autotune.py restore scripts/autotune [--card NAME] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

SUFFIX = ".autotune.json"


def cache_dir(given: str | None) -> Path:
    """Triton's cache directory: ``given``, else ``TRITON_CACHE_DIR``, else ``~/.triton/cache`` (Triton's default)."""
    return Path(given or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def card_name(given: str | None) -> str:
    """The file name of this machine's kind of card: ``given``, else the first GPU's name from nvidia-smi, lower case
    with runs of other characters turned into ``-`` (``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``)."""
    if given is None:
        given = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=True,
                               capture_output=True, text=True).stdout.splitlines()[0]
    return re.sub(r"[^a-z0-9]+", "-", given.strip().lower()).strip("-")


def best_only(record: dict) -> dict:
    """An autotuning record with only its fastest configuration (what Triton picks when it reads the file)."""
    fastest = min(record["configs_timings"], key=lambda pair: pair[1])  # Triton's order: its timings' quantiles
    return {**record, "configs_timings": [fastest]}


def save(out: Path, cache: Path, card: str) -> int:
    """Merge the choices in ``cache`` into ``out/<card>.json``; returns how many the cache held."""
    found = {str(path.relative_to(cache)): best_only(json.loads(path.read_text()))
             for path in sorted(cache.glob(f"*/*{SUFFIX}"))}
    target = out / f"{card}.json"
    merged = json.loads(target.read_text()) if target.is_file() else {}
    merged.update(found)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{json.dumps(name)}: {json.dumps(record, sort_keys=True)}" for name, record in sorted(merged.items())]
    target.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one choice per line
    return len(found)


def restore(source: Path, cache: Path, card: str) -> int:
    """Write the choices of ``source/<card>.json`` into ``cache``, leaving files it has alone; returns how many were
    written (0 where there is no file for this card)."""
    stored = source / f"{card}.json"
    if not stored.is_file():
        return 0
    written = 0
    for relative, record in json.loads(stored.read_text()).items():
        parts = Path(relative).parts
        if len(parts) != 2 or ".." in parts or not relative.endswith(SUFFIX):
            raise ValueError(f"{stored}: entry {relative!r} is not <key>/<kernel>{SUFFIX}")
        path = cache / relative
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
            written += 1
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("dir", type=Path, help="where the per-card files are (save: written; restore: read)")
    parser.add_argument("--card", default=None, help="the card's name (default: nvidia-smi's name of GPU 0)")
    parser.add_argument("--cache", default=None, help="Triton's cache directory (default: Triton's)")
    args = parser.parse_args(argv)
    cache, card = cache_dir(args.cache), card_name(args.card)
    if args.action == "save":
        print(f"autotuning choices: {save(args.dir, cache, card)} saved to {args.dir / (card + '.json')}")
    else:
        print(f"autotuning choices: {restore(args.dir, cache, card)} restored for {card} into {cache}")


if __name__ == "__main__":
    main()
