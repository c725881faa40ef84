"""One replica of a plan whose hand-offs cross replicas (run with torchrun, gloo): this rank's pieces' parameter
gradients, per-token log-probs and loss, for tests/test_handoff.py to sum over ranks and compare."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harts_hf.planner import execute_plan, plan  # noqa: E402
from tests.models import build  # noqa: E402
from tests.test_handoff import grads_of, handoff_sequences, weights_for  # noqa: E402


def main(out: Path, replicas: int, recompute: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build("qwen3_next")
    sequences = handoff_sequences(seed=3)
    the_plan = plan(sequences, token_budget=140, num_replicas=replicas, cross_replica=True)
    run = execute_plan(model, the_plan, logprob_weights=weights_for(sequences),
                       entropy_weights=weights_for(sequences, seed=1), replica=rank, recompute=recompute)
    owner = the_plan.replica_of_piece()
    torch.save(dict(grads=grads_of(model), token_logprobs=run.token_logprobs, token_entropies=run.token_entropies,
                    loss=run.loss, stats=run.stats, crossing=the_plan.cross_replica_handoffs(),
                    pieces=[p.index for p in the_plan.pieces if owner[p.index] == rank]), out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "recompute")
