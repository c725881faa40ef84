"""execute_plan: run a plan's pieces, each its own forward and backward, with the gradient of one tree forward.

A cut-off piece receives its root's ancestors from its source piece as leaf tensors (attention keys/values,
the Gated DeltaNet conv window, chunk-boundary state and replay rows, the branch token's final hidden row;
see ``harts_hf.kernels.context``). Per tree, sources first: a no-grad forward of the source produces the
hand-off; each child runs forward + backward and leaves the hand-off's gradients in the leaves' ``.grad``;
the source then runs again with gradient and backpropagates its own loss together with those gradients.
Chains recurse. Only the with-gradient forwards build graphs, and they cover every unique token exactly once.
With ``replica=r`` in a ``torch.distributed`` group, a hand-off may cross processes: the source's rank sends the
context point to point and receives its gradient back (:class:`harts_hf.planner.exchange.Exchange`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from .._checks import check_bool, check_int, check_number
from ..kernels import TreeContext, TreeExport, TreeMetadata
from ..kernels.context import compact
from ..logprobs import _ensure_patched, check_tree_inputs, tree_logprobs, unwrap_model
from ..model_patches.entry import TREE_REQUEST_KWARG, TreeRequest
from .exchange import Exchange
from .plan import Piece, Plan

__all__ = ["PieceLogprobs", "PlanExecution", "engine_backward", "execute_plan", "lead_forward"]


@dataclass
class PieceLogprobs:
    """What a per-piece loss sees: the tokens predicted in piece ``piece`` and their values.

    ``tokens [n]`` (long): packed indices in ``plan.packed``; ``logprobs [n]`` fp32, differentiable;
    ``entropies [n]`` or None. Every scored place of those tokens in the batch, TRL's per-token layout:
    ``sequence [m]``, ``position [m]`` (index into sequence's ``len - 1`` log-probs) and ``occurrence [m]`` (its
    token in ``tokens``), so ``logprobs[occurrence]`` are the per-sequence values (a shared token appears once
    per sequence through it). ``is_top1 [n]`` (bool, with ``compute_top1``): whether each token is its
    distribution's argmax.
    """

    piece: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor | None
    sequence: torch.Tensor
    position: torch.Tensor
    occurrence: torch.Tensor
    is_top1: torch.Tensor | None = None


@dataclass
class PlanExecution:
    """Result of :func:`execute_plan`, laid out as :class:`harts_hf.logprobs.TreeLogprobs`, detached.

    ``logprobs[i]`` ``[len(s_i) - 1]``; ``entropies`` likewise (or None); ``token_logprobs`` / ``token_entropies``
    ``[U]`` per packed token (0 at roots); ``loss``: the sum of the pieces' losses (None without a loss);
    ``stats``: ``pieces``, ``handoffs``, ``grad_forwards`` / ``grad_tokens`` (forwards with gradient and the
    tokens they computed: every unique token once) and ``nograd_forwards`` / ``nograd_tokens`` (forwards without
    gradient: the sources' hand-off passes, or every piece in a forward-only pass).
    ``memory`` (CUDA only, else empty): per piece and phase (``start``, ``handoff`` after a source's no-grad
    forward, ``children``, ``forward``, ``backward``), ``(piece, phase, allocated GiB, peak GiB so far)`` from
    torch's caching allocator (the peak is not reset here): where a microbatch's memory goes, piece by piece.
    ``deferred``: with ``defer_last_backward``, the last backward's ``(roots, gradients)`` (else None).
    ``is_top1``: with ``compute_top1``, per sequence ``[len(s_i) - 1]`` bool (else None). With
    ``only_loss_tokens`` a place whose token carries loss in no sequence holds 0 / False: it was not scored.
    """

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    token_logprobs: torch.Tensor
    token_entropies: torch.Tensor | None
    loss: torch.Tensor | None
    stats: dict
    memory: list = field(default_factory=list)
    deferred: tuple | None = None
    is_top1: list[torch.Tensor] | None = None


def execute_plan(model, plan: Plan, *, logprob_weights=None, entropy_weights=None,
                 loss_fn: Callable[[PieceLogprobs], torch.Tensor] | None = None, compute_entropy: bool = False,
                 temperature: float = 1.0, replica: int | None = None, recompute: bool = True,
                 gdn_backend: str = "auto", attention_backend: str = "auto", float32_head: bool = False,
                 head_chunk_size: int = 4096, entropy_grad: bool | None = None,
                 no_sync: Callable[[], AbstractContextManager] | None = None, group=None,
                 backward: Callable[[list, list], None] | None = None,
                 defer_last_backward: bool = False, schedule: str = "depth_first",
                 between_phases: Callable[[], None] | None = None, only_loss_tokens: bool = False,
                 compute_top1: bool = False) -> PlanExecution:
    """Run ``plan``'s pieces (one forward + backward each) and accumulate parameter gradients into ``.grad``,
    equal to the gradient of the same loss over one tree forward (:func:`harts_hf.tree_logprobs`).

    The loss must be a sum over tokens, given as one of:
        logprob_weights (and entropy_weights): one ``[len(s_i) - 1]`` tensor per sequence of ``plan.packed``;
            loss = sum of weight * log-prob (+ entropy weight * entropy). TRL's token-level losses linearise to
            this only at fixed ratios; for them use ``loss_fn``.
        loss_fn: called once per piece with a :class:`PieceLogprobs`; returns that piece's scalar loss. The
            total loss is the sum over pieces, so per-token terms (advantages, old/reference log-probs, masks,
            normalisers known before the pass) index their ``(B, T)`` tensors with ``sequence``/``position``.
            Sequence-level ratios (GSPO) need every piece's log-probs first: run :func:`execute_plan` without a
            loss (a forward-only pass), then the gradient pass with the sums known.
    Without either, the pass runs forward only under ``torch.no_grad`` (each piece once) and returns log-probs.

    Args:
        model: a transformers causal LM of a supported family (patched on first use), possibly wrapped.
        plan: from :func:`harts_hf.planner.plan`.
        compute_entropy: also compute entropies (implied by ``entropy_weights``).
        temperature: logits are divided by it before the softmax.
        replica: run only the pieces placed on this replica (None: all). When a hand-off crosses replicas
            (``plan(..., cross_replica=True)``), every replica must call this at the same time in a
            ``torch.distributed`` group whose rank ``r`` runs replica ``r``: a source sends its child's context
            (point to point, after its hand-off forward) and receives the context's gradient back. Each rank
            accumulates its own pieces' parameter gradients (sum them over ranks, as DDP's all-reduce does, for the
            one-forward gradient); ``logprobs`` are filled for this replica's tokens only.
        group: the ``torch.distributed`` process group of the replicas (default: the whole world).
        recompute: True: sources run a no-grad forward for the hand-off, over only their segments on the root
            paths of their children's branch tokens, and again with gradient (whole) after their children
            (activations of one piece alive at a time). False: one forward with gradient, its graph kept while the
            children run (less compute, a chain's activations in memory).
        gdn_backend / attention_backend / float32_head / head_chunk_size: as in :func:`harts_hf.tree_logprobs`.
        entropy_grad: entropies with gradient. Default: with ``entropy_weights`` or a ``loss_fn`` (which may use
            them), not with ``logprob_weights`` alone. Pass False with a ``loss_fn`` that leaves entropies out of the
            loss: an entropy with gradient that the backward never reaches keeps its LM-head chunk's ``[rows,
            vocab]`` tensors until the piece ends (~37 GiB for a 30k-token piece at vocabulary 152k).
        no_sync: a context manager factory (e.g. DDP's ``model.no_sync``) entered around every forward with
            gradient and its backward except the last pair, so a data-parallel wrapper all-reduces the gradients
            once, in the last backward (needs ``recompute=True``: each forward with gradient is then directly
            followed by its backward). None: every backward as it comes.
        backward: runs one piece's backward, ``backward(roots, gradients)`` (the piece's loss with gradient 1 and
            the hand-off tensors with their children's gradients); default ``torch.autograd.backward``. A
            DeepSpeed engine, which reduces ZeRO gradients around its own backward, goes through
            :func:`engine_backward`.
        defer_last_backward: leave the call's last backward (the last root piece's, after all its children) to the
            caller: ``PlanExecution.deferred`` holds its ``(roots, gradients)``, and the parameter gradients are
            complete once the caller backpropagates them (a trainer whose framework runs the micro-step's backward).
        schedule: the order of a training pass's forwards and backwards. ``"depth_first"``: each source's hand-off
            forward, then its children's subtrees, then its own forward+backward (at most one chain of contexts
            alive). ``"phased"``: every hand-off forward first (sources before children), then every
            forward+backward (children before sources; the last is a root's): each process's sequence is then "k
            forwards, then n pairs", which a caller pads to equal counts on every process with filler passes, as
            DeepSpeed ZeRO-3 needs (it all-gathers parameters in every module forward and backward, collectives
            that must come in the same order everywhere). Needs ``recompute=True`` and no hand-off across replicas.
        between_phases: with ``"phased"``, called once between the two phases (where the caller pads the hand-off
            forwards' phase, or starts the pairs' phase with fillers); in a forward-only pass, after its forwards.
        only_loss_tokens: score (run the LM head on) only the tokens that carry loss in some sequence of
            ``plan.packed`` (its forest's ``loss_masks``), as :func:`harts_hf.tree_logprobs` does: a loss then sees
            only those places, and the others' log-probs are 0 in the result.
        compute_top1: also whether each scored token is its distribution's argmax (``PieceLogprobs.is_top1``,
            ``PlanExecution.is_top1``; SFT's token accuracy).

    Returns:
        :class:`PlanExecution`.
    """
    if logprob_weights is not None and loss_fn is not None:
        raise ValueError("pass logprob_weights (with optional entropy_weights) or loss_fn, not both")
    if entropy_weights is not None and logprob_weights is None:
        raise ValueError("entropy_weights needs logprob_weights too (pass zeros for a pure entropy loss)")
    temperature = check_number(temperature, "execute_plan: temperature")
    head_chunk_size = check_int(head_chunk_size, "execute_plan: head_chunk_size")
    replica = check_int(replica, "execute_plan: replica", minimum=0, allow_none=True)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan is a {type(plan).__name__}; pass the Plan returned by harts_hf.planner.plan(...)")
    if schedule not in ("depth_first", "phased"):
        raise ValueError(f"schedule must be 'depth_first' or 'phased', got {schedule!r}")
    if schedule == "phased" and not recompute:
        raise ValueError("schedule='phased' needs recompute=True (its hand-off forwards run before any forward with "
                         "gradient)")
    if between_phases is not None and schedule != "phased":
        raise ValueError("between_phases is called only with schedule='phased'")
    if no_sync is not None and not recompute:
        raise ValueError("no_sync needs recompute=True (with recompute=False a source's forward with gradient runs "
                         "before its children's backwards, so no single last backward exists to synchronise)")
    runner = _PlanRunner(model, plan, compute_entropy=compute_entropy or entropy_weights is not None,
                         temperature=temperature, recompute=recompute, gdn_backend=gdn_backend,
                         attention_backend=attention_backend, float32_head=float32_head,
                         head_chunk_size=head_chunk_size,
                         entropy_grad=(entropy_weights is not None or loss_fn is not None) if entropy_grad is None
                         else entropy_grad, only_loss_tokens=check_bool(only_loss_tokens,
                                                                        "execute_plan: only_loss_tokens"),
                         compute_top1=check_bool(compute_top1, "execute_plan: compute_top1"))
    if logprob_weights is not None:
        runner.set_token_weights(logprob_weights, entropy_weights)
    elif loss_fn is not None:
        runner.loss_fn = loss_fn
    runner.no_sync, runner.backward, runner.defer_last = no_sync, backward, defer_last_backward
    roots = runner.root_pieces(replica, group)
    if schedule == "phased" and runner.exchange is not None:
        raise ValueError("schedule='phased' with hand-offs across replicas is not supported (the exchange follows "
                         "the depth-first walk); plan with cross_replica=False")
    if schedule == "phased" and runner.training:
        runner.run_phased(roots, between_phases)
        return runner.result()
    try:
        for i, piece in enumerate(roots):
            runner.visit(piece, last=i == len(roots) - 1)
    finally:
        runner.finish_sends()
    if between_phases is not None:  # a forward-only pass is one phase of forwards: after it
        between_phases()
    return runner.result()


def lead_forward(model, no_sync: Callable[[], AbstractContextManager], *, gdn_backend: str = "auto",
                 attention_backend: str = "auto") -> None:
    """DDP: a 2-token tree forward with gradient under ``no_sync``, its output dropped, run before a training
    microbatch's pieces (:func:`execute_plan` with ``no_sync``) on every process where some process may run its
    microbatch as one tree forward instead. DDP's forward issues collectives: once in training, in the first forward
    with gradient after the first synchronised backward, a bucket rebuild (with ``find_unused_parameters=False``,
    as under gradient checkpointing), then, in every forward after a synchronised one, the buffer broadcast (a model
    with buffers, such as RoPE's ``inv_freq``). A one-forward process issues both in its forward, in that order;
    pieces start with a hand-off forward without gradient, which would issue the broadcast before the rebuild (gloo:
    "Received data size doesn't match expected size", or a hang). This forward issues them as the one-forward
    process does; the pieces' forwards after it issue none until the last one outside ``no_sync``.
    ``no_sync``: the DDP wrapper's (e.g. ``functools.partial(accelerator.no_sync, model)``); ``model``: the wrapper."""
    with no_sync(), torch.enable_grad():
        tree_logprobs(model, [[0, 0]], gdn_backend=gdn_backend, attention_backend=attention_backend)


def engine_backward(engine) -> Callable[[list, list], None]:
    """``backward`` for :func:`execute_plan` through a DeepSpeed engine: one ``engine.backward`` per piece on the
    scalar ``sum(root * gradient)`` (its gradient in every root is that root's gradient), so ZeRO reduces (stage 2:
    reduce-scatters) each piece's gradients and accumulates them as it does over micro-steps, none of them a
    gradient accumulation boundary (the caller's own last backward is: ``defer_last_backward``). Each such backward
    is a collective: every process must run as many (TreeGRPOTrainer pads with zero-loss backwards). Not divided by
    the gradient accumulation steps (``scale_wrt_gas=False``, as transformers' Trainer calls DeepSpeed: the losses
    carry their own normalisation), and no loss scaling: children's gradients would be scaled twice, so fp16 is
    refused by the caller."""
    def backward(roots: list, gradients: list) -> None:
        engine.set_gradient_accumulation_boundary(False)
        engine.backward(backward_surrogate(roots, gradients), scale_wrt_gas=False)

    return backward


def backward_surrogate(roots: list, gradients: list) -> torch.Tensor:
    """A scalar whose gradient in each root is that root's gradient: ``sum(root * gradient)`` (fp32)."""
    return sum((root * gradient.to(root.dtype)).sum().float() for root, gradient in zip(roots, gradients))


class _PlanRunner:
    """State of one :func:`execute_plan` call: per-piece packings, per-token outputs and counters."""

    def __init__(self, model, plan: Plan, *, compute_entropy, temperature, recompute, gdn_backend,
                 attention_backend, float32_head, head_chunk_size, entropy_grad, only_loss_tokens=False,
                 compute_top1=False):
        self.model, self.plan, self.packed = model, plan, plan.packed
        base = unwrap_model(model)
        _ensure_patched(base)
        check_tree_inputs(base, self.packed)
        if _reentrant_checkpointing(base) and any(p.handoff is not None for p in plan.pieces):
            raise ValueError("hand-off tensors are exported from inside decoder layers, which reentrant gradient "
                             "checkpointing runs without autograd; enable it with "
                             "gradient_checkpointing_kwargs={'use_reentrant': False} (transformers' default)")
        self.device = base.get_input_embeddings().weight.device
        self.compute_entropy, self.temperature, self.recompute = compute_entropy, temperature, recompute
        self.backends = dict(gdn_backend=gdn_backend, attention_backend=attention_backend)
        self.head = dict(float32_head=float32_head, chunk_size=head_chunk_size, entropy_grad=entropy_grad,
                         compute_top1=compute_top1)
        self.only_loss_tokens, self.compute_top1 = only_loss_tokens, compute_top1
        self.loss_fn = self.no_sync = self.backward = self.deferred = None
        self.defer_last = False
        self.token_weights = self.entropy_token_weights = None
        self.children: list[list[Piece]] = [[] for _ in plan.pieces]
        for piece in plan.pieces:
            if piece.handoff is not None:
                self.children[piece.handoff.source_piece].append(piece)
        U = self.packed.num_tokens
        self.token_logprobs = torch.zeros(U, device=self.device)
        self.token_entropies = torch.zeros(U, device=self.device) if compute_entropy else None
        self.token_top1 = torch.zeros(U, dtype=torch.bool, device=self.device) if compute_top1 else None
        self.loss = None
        self.stats = {"pieces": 0, "handoffs": 0, "grad_forwards": 0, "grad_tokens": 0, "nograd_forwards": 0,
                      "nograd_tokens": 0}
        self._occurrences = None
        self.memory: list[tuple[int, str, float, float]] = []
        self.exchange: Exchange | None = None

    def _mark(self, piece: Piece, phase: str) -> None:
        if self.device.type == "cuda":
            self.memory.append((piece.index, phase, torch.cuda.memory_allocated(self.device) / 2**30,
                                torch.cuda.max_memory_allocated(self.device) / 2**30))

    # ------------------------------------------------------------------ inputs
    def set_token_weights(self, logprob_weights, entropy_weights) -> None:
        """Per-sequence weights summed onto packed tokens (a shared token's weight is the sum of its sequences')."""
        self.token_weights = self._scatter(logprob_weights, "logprob_weights")
        if entropy_weights is not None:
            self.entropy_token_weights = self._scatter(entropy_weights, "entropy_weights")

    def _scatter(self, weights, name: str) -> torch.Tensor:
        lengths = (self.packed.sequence_lengths - 1).tolist()
        if len(weights) != len(lengths):
            raise ValueError(f"{name} has {len(weights)} entries; pass one per sequence ({len(lengths)})")
        for i, (w, n) in enumerate(zip(weights, lengths)):
            if tuple(torch.as_tensor(w).shape) != (n,):
                raise ValueError(f"{name}[{i}] has shape {tuple(torch.as_tensor(w).shape)}; sequence {i} has "
                                 f"{n + 1} tokens, so it needs [{n}] (one weight per predicted token)")
        _, token, _ = self.occurrences()
        flat = torch.cat([torch.as_tensor(w, dtype=torch.float32).reshape(-1) for w in weights]).to(self.device)
        return torch.zeros(self.packed.num_tokens, device=self.device).index_add(0, token, flat)

    def occurrences(self):
        """``(sequence, token, position)`` of every scored place (positions 1.. of every sequence), on device."""
        if self._occurrences is None:
            packed = self.packed
            lengths = packed.sequence_lengths.cpu()
            sequence = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
            position = torch.arange(sequence.shape[0]) - packed.sequence_offsets.cpu()[:-1][sequence] - 1
            keep = position >= 0
            token = packed.sequence_token_index.cpu()[keep]
            self._occurrences = tuple(x.to(self.device) for x in (sequence[keep], token, position[keep]))
        return self._occurrences

    def root_pieces(self, replica: int | None, group=None) -> list[Piece]:
        """The pieces this call starts from, in the order every replica walks them. Sets up the point-to-point
        exchange when a hand-off crosses replicas."""
        pieces = self.plan.pieces
        if replica is None:
            return [p for p in pieces if p.handoff is None]
        if not 0 <= replica < len(self.plan.replicas):
            raise ValueError(f"replica={replica!r}; the plan has replicas 0..{len(self.plan.replicas) - 1}")
        owner = self.plan.replica_of_piece()
        crossing = [p.index for p in pieces if p.handoff is not None
                    and replica in (owner[p.index], owner[p.handoff.source_piece])
                    and owner[p.index] != owner[p.handoff.source_piece]]
        if not crossing:  # everything this replica needs is local
            return [p for p in pieces if p.handoff is None and owner[p.index] == replica]
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"pieces {crossing} hand off across replicas, which needs torch.distributed: run every "
                             "replica in its own process of an initialised process group (e.g. accelerate launch or "
                             "torchrun), or plan with cross_replica=False")
        if dist.get_world_size(group) != len(self.plan.replicas) or dist.get_rank(group) != replica:
            raise ValueError(f"replica={replica} in a group of {dist.get_world_size(group)} processes (this one is "
                             f"rank {dist.get_rank(group)}); the plan has {len(self.plan.replicas)} replicas: run "
                             "replica r on group rank r")
        if self.no_sync is not None:
            raise ValueError("no_sync with hand-offs across replicas is not supported: each rank's backwards depend "
                             "on the others' (pass no_sync=None and reduce the gradients after the call)")
        self.exchange = Exchange(replica, owner, group, self.device)
        return [p for p in pieces if p.handoff is None]  # every replica walks every tree, in the same order

    def _here(self, piece: Piece) -> bool:
        return self.exchange is None or self.exchange.is_local(piece)

    def visit(self, piece: Piece, last: bool = False) -> None:
        """Run ``piece`` here, or, if another replica runs it, walk its subtree for the pieces placed here."""
        if self._here(piece):
            self.run(piece, None, last=last)
        else:
            self._walk_remote(piece)

    def _walk_remote(self, piece: Piece) -> None:
        """``piece`` runs on another replica: its children placed here get their context from it and send the
        context's gradient back; the others are walked further down."""
        for child in self.children[piece.index]:
            if not self.exchange.is_local(child):
                self._walk_remote(child)
                continue
            source = self.exchange.owner[piece.index]
            context = self.exchange.receive_context(source, child.handoff.ancestor_tokens, self.training)
            self.run(child, context)
            if self.training:
                self.exchange.send_gradients(context, source)

    def finish_sends(self) -> None:
        if self.exchange is not None:
            self.exchange.wait()

    @property
    def training(self) -> bool:
        return self.loss_fn is not None or self.token_weights is not None

    def _run_children(self, children: list[Piece], exports: list[TreeExport]) -> list[dict]:
        """Each child, here or on its replica; per child the gradients of its context by key (empty without
        training)."""
        training, gradients = self.training, []
        for child, export in zip(children, exports):
            if self._here(child):
                context = export.as_context(requires_grad=training)
                self.run(child, context)
                # kept until the source's backward: a gradient that is a view of a whole layer's input gradient
                # (the context rows of a cat) would hold that gradient alive for every child
                gradients.append({key: compact(leaf.grad) for key, leaf in context.tensors.items()} if training else {})
                continue
            destination = self.exchange.owner[child.index]
            self.exchange.send_context(export, destination)
            self._walk_remote(child)
            gradients.append(self.exchange.receive_gradients(destination, export) if training else {})
        return gradients

    # ------------------------------------------------------------------ execution
    def _prepare(self, piece: Piece, context: TreeContext | None):
        """``piece``'s packed token ids (global), its tree (exporting its children's hand-offs) and its targets."""
        tokens = self.packed.segment_tokens(piece.segments)
        exports = self._exports(tokens, self.children[piece.index])
        if context is not None and context.ancestor_tokens != piece.handoff.ancestor_tokens:
            raise ValueError(f"piece {piece.index}: context has {context.ancestor_tokens} ancestors, its hand-off "
                             f"{piece.handoff.ancestor_tokens}")
        tree = TreeMetadata(self.packed.select(piece.segments), self.device, context=context, exports=exports,
                            **self.backends)
        scored = self.packed.parent[tokens] >= 0
        if self.only_loss_tokens:
            scored &= self.packed.loss_mask[tokens]
        targets = torch.nonzero(scored).squeeze(1).to(self.device)
        return tokens, tree, targets

    @staticmethod
    def _exports(tokens: torch.Tensor, children: list[Piece]) -> list[TreeExport]:
        """One export per child, at its branch token's place among ``tokens`` (increasing packed ids)."""
        return [TreeExport(int(np.searchsorted(tokens.numpy(), child.handoff.branch_token)),
                           child.handoff.ancestor_tokens) for child in children]

    def run(self, piece: Piece, context: TreeContext | None, last: bool = False) -> None:
        """Forward (and backward) ``piece`` and, recursively, its children; hand-off gradients end up in the
        ``.grad`` of ``context``'s leaves. ``last``: this piece's backward is the call's last one (not under
        ``no_sync``)."""
        tokens, tree, targets = self._prepare(piece, context)
        children = self.children[piece.index]
        self.stats["pieces"] += 1
        self.stats["handoffs"] += len(children)
        self._mark(piece, "start")
        if not self.training:
            output = self._forward(tree, targets, grad=False)
            self._store(tokens, targets, output)
            self._run_children(children, tree.exports)
            return
        output, exports = None, tree.exports
        if children:
            if self.recompute:
                exports = self._handoff_forward(piece, context)
            else:
                output = self._forward(tree, targets, grad=True)
            self._mark(piece, "handoff")
        child_gradients = self._run_children(children, exports)
        if children:
            self._mark(piece, "children")
        self._train(piece, tokens, tree, targets, child_gradients, last, output)

    def run_phased(self, roots: list[Piece], between_phases: Callable[[], None] | None) -> None:
        """The same pieces in two phases: every source's hand-off forward (no gradient; sources before their
        children), then every forward+backward (children before their source, the first root's last), so that
        the sequence of forwards and backwards is "k hand-off forwards, then n pairs" on every process, which
        fillers can pad to the same counts everywhere. ``between_phases`` runs between the two."""
        order: list[Piece] = []

        def walk(piece: Piece) -> None:
            order.append(piece)
            for child in self.children[piece.index]:
                walk(child)

        for root in roots:
            walk(root)
        contexts: dict[int, TreeContext] = {}
        for piece in order:
            children = self.children[piece.index]
            self.stats["pieces"] += 1
            self.stats["handoffs"] += len(children)
            if not children:
                continue
            self._mark(piece, "start")
            exports = self._handoff_forward(piece, contexts.get(piece.index))
            for child, export in zip(children, exports):
                contexts[child.index] = export.as_context(requires_grad=True)
            self._mark(piece, "handoff")
        if between_phases is not None:
            between_phases()
        gradients: dict[int, dict] = {}
        for i, piece in enumerate(reversed(order)):  # reversed pre-order: every child before its source
            context = contexts.pop(piece.index, None)
            tokens, tree, targets = self._prepare(piece, context)
            self._mark(piece, "start")
            child_gradients = [gradients.pop(child.index) for child in self.children[piece.index]]
            self._train(piece, tokens, tree, targets, child_gradients, i == len(order) - 1, None)
            if context is not None:
                gradients[piece.index] = {key: compact(leaf.grad) for key, leaf in context.tensors.items()}

    def _train(self, piece: Piece, tokens, tree: TreeMetadata, targets, child_gradients: list[dict], last: bool,
               output) -> None:
        """``piece``'s forward with gradient (unless ``output`` holds it) and its backward from its loss and its
        children's hand-off gradients."""
        with nullcontext() if last or self.no_sync is None else self.no_sync():
            if output is None:
                output = self._forward(tree, targets, grad=True)
            self._mark(piece, "forward")
            self._store(tokens, targets, output)
            loss = self._piece_loss(piece, tokens, targets, output)
            roots, grads = [], []
            if loss.requires_grad:
                roots.append(loss)
                grads.append(torch.ones_like(loss))
            for export, gradients in zip(tree.exports, child_gradients):
                for key, gradient in gradients.items():
                    if gradient is not None and export.tensors[key].requires_grad:
                        roots.append(export.tensors[key])
                        grads.append(gradient)
            if last and self.no_sync is not None:
                # the synchronised backward must reach every trainable parameter (DDP's reducer waits for all of
                # them), but the last piece may not use them all (a 1-token root whose children were all cut off
                # predicts no token and skips the LM head; unrouted experts): a zero-weighted term touches each
                trainable = [p for p in self.model.parameters() if p.requires_grad]
                if trainable:
                    roots.append(torch.stack([p.reshape(-1)[0].float() for p in trainable]).sum() * 0.0)
                    grads.append(torch.ones((), device=roots[-1].device))
            if last and self.defer_last:
                self.deferred = (roots, grads)
            elif roots:
                (self.backward or torch.autograd.backward)(roots, grads)
            self._mark(piece, "backward")
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()

    def _handoff_forward(self, piece: Piece, context: TreeContext | None) -> list[TreeExport]:
        """The forward without gradient that hands ``piece``'s children their contexts, over only the segments of
        ``piece`` on the root paths of its children's branch tokens (a token's keys, values and states depend on
        its ancestors alone; for the Qwen3-Next preset's full-size `swe` at 131,072-token pieces, 19,665 of the
        source's 113,273 tokens). Returns the filled exports, in the order of ``self.children[piece.index]``."""
        children = self.children[piece.index]
        segment_of, parent = self.packed.segment_of_token(), self.packed.segment_parent
        inside, needed = set(piece.segments), set()
        for child in children:
            # up the branch token's root path to the piece's root, or to a segment another child already took
            segment = int(segment_of[child.handoff.branch_token])
            while segment in inside and segment not in needed:
                needed.add(segment)
                segment = int(parent[segment])
        segments = sorted(needed)
        tree = TreeMetadata(self.packed.select(segments), self.device, context=context,
                            exports=self._exports(self.packed.segment_tokens(segments), children), **self.backends)
        self._forward(tree, torch.zeros(0, dtype=torch.long, device=self.device), grad=False)
        return tree.exports

    def _forward(self, tree: TreeMetadata, targets: torch.Tensor, *, grad: bool):
        for export in tree.exports:
            export.tensors.clear()
        request = TreeRequest(tree, targets, temperature=self.temperature, compute_entropy=self.compute_entropy,
                              **self.head)
        with torch.set_grad_enabled(grad):
            output = self.model(**{TREE_REQUEST_KWARG: request})
        kind = "grad" if grad else "nograd"
        self.stats[f"{kind}_forwards"] += 1
        self.stats[f"{kind}_tokens"] += tree.num_tokens
        missing = [export.branch_token for export in tree.exports if ("hidden",) not in export.tensors]
        if missing:
            raise RuntimeError(f"the forward did not export the hand-off at branch tokens {missing}")
        return output

    def _store(self, tokens, targets, output) -> None:
        where = tokens.to(self.device)[targets]
        self.token_logprobs[where] = output.logprobs.detach()
        if self.compute_entropy:
            self.token_entropies[where] = output.entropies.detach()
        if self.compute_top1:
            self.token_top1[where] = output.is_top1

    def _piece_loss(self, piece: Piece, tokens, targets, output) -> torch.Tensor:
        where = tokens.to(self.device)[targets]
        if self.loss_fn is None:
            loss = (self.token_weights[where] * output.logprobs).sum()
            if self.entropy_token_weights is not None:
                loss = loss + (self.entropy_token_weights[where] * output.entropies).sum()
            return loss
        sequence, token, position = self.occurrences()
        mask = torch.zeros(self.packed.num_tokens, dtype=torch.bool, device=self.device)
        mask[where] = True
        chosen = mask[token]
        lookup = torch.full((self.packed.num_tokens,), -1, dtype=torch.long, device=self.device)
        lookup[where] = torch.arange(where.shape[0], device=self.device)
        scored = PieceLogprobs(piece.index, where, output.logprobs, output.entropies, sequence[chosen],
                               position[chosen], lookup[token[chosen]],
                               output.is_top1 if self.compute_top1 else None)
        loss = self.loss_fn(scored)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar tensor for piece {piece.index}, got {loss!r:.80}")
        return loss

    def result(self) -> PlanExecution:
        packed = self.packed.to(self.device) if self.packed.device != self.device else self.packed
        logprobs = [x[1:] for x in packed.gather_sequences(self.token_logprobs)]
        entropies = [x[1:] for x in packed.gather_sequences(self.token_entropies)] if self.compute_entropy else None
        top1 = [x[1:] for x in packed.gather_sequences(self.token_top1)] if self.compute_top1 else None
        return PlanExecution(logprobs, entropies, self.token_logprobs, self.token_entropies, self.loss,
                             dict(self.stats), list(self.memory), self.deferred, top1)


def _reentrant_checkpointing(model) -> bool:
    """True when some layer of ``model`` runs under reentrant activation checkpointing."""
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and function is not None:
            if getattr(function, "keywords", {}).get("use_reentrant", True):
                return True
    return False
