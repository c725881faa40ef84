"""scripts/triton_autotune.py: Triton's autotuning choices saved from one device machine's cache and restored into a
fresh one's, in the layout Triton reads (``<key>/<kernel>.autotune.json``), the fastest configuration kept."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "triton_autotune.py"
spec = importlib.util.spec_from_file_location("triton_autotune", SCRIPT)
triton_autotune = importlib.util.module_from_spec(spec)
spec.loader.exec_module(triton_autotune)

SLOW = [{"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 2, "pre_hook": None}, [0.3, 0.2, 0.4]]
FAST = [{"kwargs": {"BK": 32}, "num_warps": 2, "num_stages": 3, "pre_hook": None}, [0.1, 0.09, 0.2]]
FAILED = [{"kwargs": {"BK": 128}, "num_warps": 8, "num_stages": 4, "pre_hook": None}, [float("inf")] * 3]


def _cache(root: Path) -> Path:
    """A Triton cache holding two kernels' choices and a compiled binary beside one of them."""
    cache = root / "cache"
    for key, kernel, timings in (("AAAA", "chunk_fwd", [SLOW, FAST, FAILED]), ("BBBB", "l2norm", [FAST])):
        (cache / key).mkdir(parents=True)
        (cache / key / f"{kernel}.autotune.json").write_text(
            json.dumps({"key": [64, "torch.bfloat16"], "configs_timings": timings}))
    (cache / "AAAA" / "chunk_fwd.cubin").write_bytes(b"\0binary")
    return cache


def test_saved_choices_restore_into_a_fresh_cache(tmp_path):
    cache = _cache(tmp_path)
    assert triton_autotune.save(tmp_path / "out", cache, "nvidia-h100-80gb-hbm3") == 2
    stored = json.loads((tmp_path / "out" / "nvidia-h100-80gb-hbm3.json").read_text())
    assert sorted(stored) == ["AAAA/chunk_fwd.autotune.json", "BBBB/l2norm.autotune.json"]
    assert stored["AAAA/chunk_fwd.autotune.json"]["configs_timings"] == [FAST]  # the fastest alone

    fresh = tmp_path / "fresh"
    assert triton_autotune.restore(tmp_path / "out", fresh, "nvidia-h100-80gb-hbm3") == 2
    restored = json.loads((fresh / "AAAA" / "chunk_fwd.autotune.json").read_text())
    assert restored == {"key": [64, "torch.bfloat16"], "configs_timings": [FAST]}
    assert sorted(p.name for p in fresh.rglob("*") if p.is_file()) == ["chunk_fwd.autotune.json",
                                                                       "l2norm.autotune.json"]
    # a second restore, and another card's, write nothing
    assert triton_autotune.restore(tmp_path / "out", fresh, "nvidia-h100-80gb-hbm3") == 0
    assert triton_autotune.restore(tmp_path / "out", tmp_path / "other", "nvidia-h200") == 0
    assert not (tmp_path / "other").exists()


def test_restore_keeps_the_caches_own_files_and_save_merges(tmp_path):
    cache = _cache(tmp_path)
    triton_autotune.save(tmp_path / "out", cache, "card")
    own = cache / "AAAA" / "chunk_fwd.autotune.json"
    own.write_text(json.dumps({"key": [1], "configs_timings": [SLOW]}))
    assert triton_autotune.restore(tmp_path / "out", cache, "card") == 0
    assert json.loads(own.read_text())["configs_timings"] == [SLOW]

    other = tmp_path / "second_machine"
    (other / "CCCC").mkdir(parents=True)
    (other / "CCCC" / "wy.autotune.json").write_text(json.dumps({"key": [2], "configs_timings": [FAST]}))
    triton_autotune.save(tmp_path / "out", other, "card")
    stored = json.loads((tmp_path / "out" / "card.json").read_text())
    assert sorted(stored) == ["AAAA/chunk_fwd.autotune.json", "BBBB/l2norm.autotune.json", "CCCC/wy.autotune.json"]


def test_card_names_and_bad_entries(tmp_path):
    assert triton_autotune.card_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert triton_autotune.card_name(" NVIDIA H200 ") == "nvidia-h200"
    (tmp_path / "card.json").write_text(json.dumps({"../outside.autotune.json": {"configs_timings": [FAST]}}))
    with pytest.raises(ValueError, match="is not <key>/<kernel>.autotune.json"):
        triton_autotune.restore(tmp_path, tmp_path / "cache", "card")
