"""Refit the planner's cost model to committed full-size H200 measurements, and test it on held-out forests.

    python -m benchmarks refit tau=benchmarks/results/2026-12-01/plan_memory_probe_tau_fused_headline.json \
        grpo=benchmarks/results/2026-12-01/plan_memory_probe_grpo_fused_headline.json \
        distinct=benchmarks/results/2026-12-01/plan_memory_probe_distinct.json --out refit.json

Runs on the CPU: each ``WORKLOAD=PROBE_JSON`` names a ``plan_memory_probe.py --scale 1.0`` result of that workload
preset (a workload may be named more than once: its tree and its packed path from different runs). Its forests are
rebuilt from the preset (the probe's seed 0 and vocabulary): the tree with its measured seconds (one piece, or the
planner's pieces at the probe's budget), every call of the packed per-trajectory path (consecutive trajectories, each
its own tree, as the probe ran them; each call's measured seconds), and every piece of a ``--replicas`` run (the
planner's placement on 2-8 ranks timed piece by piece: small forests with hand-offs, one call each). Every forest's
features are the planner's own (``harts_hf.planner.plan`` over the forest as one piece plus its one microbatch, or over
its pieces, summed, one microbatch each), so the fit prices what the planner prices. The coefficients are fitted by
non-negative least squares on every forest; the table gives each forest's measured seconds and the relative error of
three predictions: the refit's, a fit on the OTHER workloads only (the forest held out: leave-one-workload-out), and
the library's current defaults (``CostModel()``); ``--model JSON`` adds a fourth, a saved cost model's (one fitted on
earlier runs: tested on these, which it never saw). ``--out`` writes the coefficients and the table; ``--save-model``
writes the refit as a cost model file (TreeGRPOConfig's ``tree_cost_model``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_tree_vs_trajectory import MODELS  # noqa: E402
from packed_path import consecutive_groups  # noqa: E402
from plan_memory_probe import task_sequences  # noqa: E402


def forest_features(sequences, separate: bool) -> dict:
    """The planner's features of ``sequences`` as one piece in one microbatch (``separate``: every sequence its own
    tree, as the packed per-trajectory path computes them)."""
    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest

    groups = list(range(len(sequences))) if separate else None
    packed = PrefixForest.from_sequences(sequences, groups=groups).pack()
    pieces = plan(packed, num_replicas=1, token_budget=packed.num_tokens).pieces
    features = {key: sum(p.features[key] for p in pieces) for key in pieces[0].features}
    features["rounds"] = max(p.features["rounds"] for p in pieces)
    features["microbatches"] = 1
    return features


def plan_features(sequences, budget: int | None, pieces: int) -> dict:
    """The planner's features of ``sequences`` planned in pieces of at most ``budget`` tokens (None: the whole forest)
    on one replica, summed over the pieces (each piece one forward+backward call: ``microbatches`` counts them; its
    state-pass rounds add up). The hand-off sources' extra forward without gradient (``execute_plan(recompute=True)``)
    is not a feature: the planner does not price it."""
    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest

    packed = PrefixForest.from_sequences(sequences).pack()
    the_plan = plan(packed, num_replicas=1, token_budget=budget or packed.num_tokens)
    if len(the_plan.pieces) != pieces:
        raise ValueError(f"the rebuilt plan has {len(the_plan.pieces)} pieces, the probe ran {pieces} (another "
                         f"planner or budget?)")
    features = {key: sum(p.features[key] for p in the_plan.pieces) for key in the_plan.pieces[0].features}
    features["microbatches"] = len(the_plan.pieces)
    return features


def piece_samples(workload: str, sequences, balance: dict) -> list[dict]:
    """One sample per piece of a ``--replicas`` run (``balance``: its ``replica_balance`` record): the piece's planner
    features, one call (``microbatches`` 1), and its measured seconds (its hand-off forward included). The plan is
    rebuilt with the record's ``pieces_per_replica`` (records without it were planned with 4, the planner's fixed
    choice until 2026-12-04)."""
    from harts_hf.planner import plan
    from harts_hf.trees import PrefixForest

    packed = PrefixForest.from_sequences(sequences).pack()
    the_plan = plan(packed, num_replicas=balance["replicas"], token_budget=balance["budget"] or packed.num_tokens,
                    pieces_per_replica=balance.get("pieces_per_replica", 4))
    tokens = [piece.unique_tokens for piece in the_plan.pieces]
    if len(tokens) != balance["pieces"] or tokens != balance.get("piece_tokens", tokens):
        ran = balance.get("piece_tokens", f"{balance['pieces']} pieces")
        raise ValueError(f"the rebuilt {balance['replicas']}-replica plan has pieces of {tokens} tokens, the probe "
                         f"ran {ran} (another planner?)")
    return [dict(name=f"{workload} {balance['replicas']}-rank piece {piece.index}",
                 features=dict(piece.features, microbatches=1), seconds=seconds)
            for piece, seconds in zip(the_plan.pieces, balance["piece_seconds"])]


def samples_of(workload: str, path: str, model: str = "qwen3_next_2b") -> list[dict]:
    """The tree, packed-call and rank-piece samples of one probe result: ``{name, features, seconds}``."""
    rows = json.loads(Path(path).read_text())
    sequences = task_sequences(1.0, MODELS[model]["vocab_size"], workload=workload)
    samples = [s for r in rows if "replica_balance" in r for s in piece_samples(workload, sequences,
                                                                                  r["replica_balance"])]
    trees = [r for r in rows if r.get("pieces") and r.get("keep_attention", "on") == "on"
             and not r.get("stored_layers")]
    if trees:
        tree = trees[0]
        samples.append(dict(name=f"{workload} tree" + ("" if tree["pieces"] == 1 else f", {tree['pieces']} pieces"),
                            features=plan_features(sequences, tree["budget"], tree["pieces"]),
                            seconds=tree["seconds"]))
    packed = next((r["packed_groups"] for r in rows if "packed_groups" in r), None)
    if packed is not None:
        groups = list(consecutive_groups(sequences, packed["max_tokens"]))
        if [len(g) for g in groups] != [g["trajectories"] for g in packed["groups"]]:
            raise ValueError(f"{path}: the rebuilt packed calls do not match the probe's (another seed or scale?)")
        for k, (group, measured) in enumerate(zip(groups, packed["groups"])):
            samples.append(dict(name=f"{workload} packed call {k}", features=forest_features(group, separate=True),
                                seconds=measured["seconds"]))
    return samples


def main(argv=None):
    from harts_hf.planner import FEATURES, CostModel

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", metavar="WORKLOAD=PROBE_JSON")
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-model", default=None, metavar="JSON",
                        help="also write the refit as a cost model file (CostModel.save): TreeGRPOConfig's "
                             "tree_cost_model takes its path")
    parser.add_argument("--model", default=None, metavar="JSON",
                        help="also price every forest with this saved cost model (CostModel.save; e.g. a refit of "
                             "earlier runs) and give its error in a column of its own")
    args = parser.parse_args(argv)
    by_workload: dict[str, list[dict]] = {}
    for workload, path in (item.split("=", 1) for item in args.results):  # a workload may come in several files
        by_workload.setdefault(workload, []).extend(samples_of(workload, path))
    fit = lambda samples: CostModel.fit([s["features"] for s in samples], [s["seconds"] for s in samples])  # noqa: E731
    everything = [s for samples in by_workload.values() for s in samples]
    refit, default = fit(everything), CostModel()
    saved = CostModel.load(args.model) if args.model else None
    columns = ("refit", "held_out", "default") + (("saved",) if saved else ())
    table = []
    print(f"{'forest':24s} {'unique':>7s} {'pairs':>9s} {'replay':>6s} {'rounds':>6s} {'measured':>8s} {'refit':>7s} "
          f"{'held out':>8s} {'default':>8s}" + (f" {'saved':>8s}" if saved else ""))
    for workload, samples in by_workload.items():
        others = fit([s for w, group in by_workload.items() if w != workload for s in group]) \
            if len(by_workload) > 1 else None
        for s in samples:
            f, measured = s["features"], s["seconds"]
            errors = {name: model.cost(f) / measured - 1 for name, model in
                      (("refit", refit), ("held_out", others), ("default", default), ("saved", saved))
                      if model is not None}
            table.append(dict(s, errors=errors))
            print(f"{s['name']:24s} {f['unique_tokens']:7d} {f['attention_pairs']:9.3g} {f['replay_tokens']:6d} "
                  f"{f['rounds']:6d} {measured:8.3f} " + " ".join(f"{errors.get(k, float('nan')):+8.1%}"
                                                                for k in columns))
    coefficients = {name: getattr(refit, name) for name in FEATURES}
    print("refit (seconds per unit):", {k: float(f"{v:.4g}") for k, v in coefficients.items()})
    if args.out:
        from run_record import run_record

        Path(args.out).write_text(json.dumps(dict(coefficients=coefficients, samples=table, run=run_record()),
                                             indent=1))
    if args.save_model:
        refit.save(args.save_model)
    return refit, table


if __name__ == "__main__":
    main()
