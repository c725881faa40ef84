"""Point-to-point hand-offs between data-parallel replicas for :func:`harts_hf.planner.execute_plan`: a source
piece's rank sends its child's context to the child's rank and receives the context's gradient back."""

from __future__ import annotations

import pickle

import torch

from ..kernels import TreeContext, TreeExport
from ..kernels.context import compact
from .plan import Piece

__all__ = ["Exchange"]


class Exchange:
    """Point-to-point hand-offs between replicas (rank ``r`` of ``group`` runs replica ``r``).

    Every replica walks every tree in the same order, so the two ends of a hand-off meet in the same order: the
    source sends its child's context right after its hand-off forward and receives the gradient when it needs it;
    the child's replica receives the context when it reaches the child and sends the gradient after the child's
    backward. Sends are asynchronous (a send never waits for its receiver), receives block; a receive only ever
    waits for a send that comes earlier in the shared order, so the replicas cannot deadlock. A message is a
    pickled header (keys, shapes, dtypes) and then the tensors, on CPU for gloo and on the device otherwise."""

    def __init__(self, replica: int, owner: dict[int, int], group, device):
        import torch.distributed as dist

        self.dist, self.replica, self.owner, self.group, self.device = dist, replica, owner, group, device
        self.wire = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
        self.pending: list = []

    def is_local(self, piece: Piece) -> bool:
        return self.owner[piece.index] == self.replica

    def _peer(self, replica: int) -> int:
        return replica if self.group is None else self.dist.get_global_rank(self.group, replica)

    def _send(self, tensor: torch.Tensor, replica: int) -> None:
        # kept in ``pending`` until the send completes: not as a view of a larger tensor (a context row's gradient)
        tensor = compact(tensor.detach().to(self.wire).contiguous())
        self.pending.append((tensor, self.dist.isend(tensor, self._peer(replica), group=self.group)))

    def _receive(self, shape, dtype, replica: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.wire)
        self.dist.recv(tensor, self._peer(replica), group=self.group)
        return tensor.to(self.device)

    def _send_header(self, header: list, replica: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
        self._send(torch.tensor([payload.numel()], dtype=torch.long), replica)
        self._send(payload, replica)

    def _receive_header(self, replica: int) -> list:
        size = int(self._receive((1,), torch.long, replica).item())
        return pickle.loads(self._receive((size,), torch.uint8, replica).cpu().numpy().tobytes())

    def send_context(self, export: TreeExport, replica: int) -> None:
        items = list(export.tensors.items())
        self._send_header([(key, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for key, t in items], replica)
        for _, tensor in items:
            self._send(tensor, replica)

    def receive_context(self, replica: int, ancestor_tokens: int, requires_grad: bool) -> TreeContext:
        tensors = {}
        for key, shape, dtype in self._receive_header(replica):
            tensors[key] = self._receive(shape, getattr(torch, dtype), replica).requires_grad_(requires_grad)
        return TreeContext(ancestor_tokens, tensors)

    def send_gradients(self, context: TreeContext, replica: int) -> None:
        leaves = list(context.tensors.values())
        self._send(torch.tensor([leaf.grad is not None for leaf in leaves], dtype=torch.uint8), replica)
        for leaf in leaves:
            if leaf.grad is not None:
                self._send(leaf.grad, replica)

    def receive_gradients(self, replica: int, export: TreeExport) -> dict:
        """The gradients of the context sent from ``export`` (same keys, shapes and dtypes; None where the child did
        not use a tensor)."""
        items = list(export.tensors.items())
        present = self._receive((len(items),), torch.uint8, replica).tolist()
        return {key: self._receive(tuple(t.shape), t.dtype, replica) if flag else None
                for (key, t), flag in zip(items, present)}

    def wait(self) -> None:
        for _, work in self.pending:
            work.wait()
        self.pending.clear()
