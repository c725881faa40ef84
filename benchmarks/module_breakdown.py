"""Where a forward+backward's time goes, by model part: GDN layers (and inside them the tree conv and the gated delta
rule), attention layers (and inside them the attention kernel), MLPs, the decoder layers' norms, the LM head, the
rest.

    with labelled(model):
        with torch.profiler.profile(activities=[CPU, CUDA]) as prof:
            loss = ...; loss.backward()
    parts = attribute(prof.events(), on_cuda=True)

``labelled`` opens a ``record_function`` range named ``harts::<part>`` around every call of the model's GDN,
attention and MLP modules (forward hooks) and of harts_hf's tree conv, gated delta rule, tree attention and chunked
head (wrapped where the model patches call them). ``attribute`` gives each profiled op's own time (device time on
CUDA, CPU time on CPU) to its innermost range:

- an op inside a range: that part's ``forward`` (``recompute`` when the range runs inside a backward node, as
  gradient checkpointing's recomputed forwards do; the decoder layers' own norms are a part, ``layer_norms``, so that
  what a checkpointed layer recomputes lies in a range, but for its two residual adds, which count as backward);
- an op inside a backward node (``autograd::engine::evaluate_function: ...``) and no range below it: the part whose
  range held the forward op that made the node (autograd's sequence number, per forward thread): that part's
  ``backward``. Sequence numbers below a node are not read: on the H200 (torch 2.11, CUDA's autograd thread) the
  engine records each node a second time under its own name (``AddBackward0`` inside ``evaluate_function:
  AddBackward0``) with the node's number, and a rule that took a numbered op below a node for a recomputed forward
  booked nearly the whole backward as ``other``'s recompute (802 of 5,849 ops below nodes were numbered);
- anything else: ``other`` (embedding, the residual adds of the first forward, final norm, the loss).

Device time no op claims (kernels whose launch the profiler did not link to an op) is reported as
``unattributed``, so a part never silently loses time. The GPU-side copies of the ranges (Kineto's
``gpu_user_annotation`` events, spans from a range's first kernel to its last) are not kernels and are left out.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch
from torch.autograd.profiler import record_function

PREFIX = "harts::"
MODULE_PARTS = (("GatedDeltaNet", "gdn_layer"), ("DeltaAttention", "gdn_layer"), ("Mixer", "gdn_layer"),
                ("MambaLayer", "gdn_layer"), ("Attention", "attention_layer"), ("MLP", "mlp"), ("MoE", "mlp"),
                ("SparseMoeBlock", "mlp"))
"""Class-name suffix -> part, for the model's own modules, the first suffix that matches: ``gdn_layer`` is every
linear-recurrence mixer (Gated DeltaNet; Kimi Delta Attention, whose classes end in ``Attention`` too; the Mamba-2
mixers of Nemotron-H, Bamba, Falcon-H1 and Granite-4 hybrid), ``mlp`` every feed-forward block, MoE ones included."""
LAYER_NORMS = (("DecoderLayer", "Block"), "RMSNorm", "layer_norms")
"""A decoder layer's own norms (children of a module whose class name ends with one of the first, Nemotron-H's
blocks included, their class name with the second): the part named last."""
FUNCTION_PARTS = (("harts_hf.model_patches.gated_deltanet", "tree_causal_conv1d", "conv"),
                  ("harts_hf.model_patches.gated_deltanet", "tree_gated_delta_rule", "gdn_kernel"),
                  ("harts_hf.model_patches.core", "tree_attention", "attention_kernel"),
                  ("harts_hf.model_patches.entry", "chunked_logprobs", "head"),
                  ("harts_hf.kernels.chunked_logprobs", "_score_chunk", "head"))
"""(module, name, part): harts_hf functions, wrapped where their callers look them up (the head's row chunks too:
past one chunk they are checkpointed, and their recomputation runs in the backward, outside the head's range)."""
BACKWARD = "autograd::engine::evaluate_function: "


def _part_of_module(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    return next((part for suffix, part in MODULE_PARTS if name.endswith(suffix)), None)


def _labelled_function(function, part: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with record_function(PREFIX + part):
            return function(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def labelled(model: torch.nn.Module):
    """Name every call of the model's parts (see the module docstring) for the profiler; undone on exit."""
    import importlib

    handles, open_ranges, wrapped = [], [], []

    def enter(part, module, args):
        scope = record_function(PREFIX + part)
        scope.__enter__()
        open_ranges.append(scope)

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    layer, norm, norms_part = LAYER_NORMS
    layer_norms = {id(child) for module in model.modules() if type(module).__name__.endswith(layer)
                   for child in module.children() if type(child).__name__.endswith(norm)}
    for module in model.modules():
        part = norms_part if id(module) in layer_norms else _part_of_module(module)
        if part is not None:
            handles.append(module.register_forward_pre_hook(functools.partial(enter, part)))
            # always_call: also when the forward raises, as checkpointing's early stop does inside a recomputed
            # forward once it has the tensors it needs (a range left open would misnest every later one)
            handles.append(module.register_forward_hook(leave, always_call=True))
    for module_name, name, part in FUNCTION_PARTS:
        owner = importlib.import_module(module_name)
        original = getattr(owner, name)
        setattr(owner, name, _labelled_function(original, part))
        wrapped.append((owner, name, original))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, name, original in wrapped:
            setattr(owner, name, original)


def is_kernel(event) -> bool:
    """A device event that is a kernel or copy: not Kineto's GPU-side copy of a ``record_function`` range
    (``gpu_user_annotation``, which spans other kernels) and not CUPTI's "Command Buffer Full" marker."""
    return (event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            and event.key != "Command Buffer Full")


def _own_seconds(event, on_cuda: bool) -> float:
    return (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / 1e6


def attribute(events, on_cuda: bool) -> dict:
    """``{part: {"forward": s, "recompute": s, "backward": s}}`` plus ``"other"`` and, on CUDA, ``"unattributed"``
    and ``"total"`` (all device time), from ``prof.events()`` of a run under :func:`labelled`."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]

    def enclosing(event):
        """The innermost labelled range and the innermost backward node above ``event`` (or itself), and which
        of the two is nearer."""
        label = node = nearer = None
        current = event
        while current is not None and (label is None or node is None):
            if label is None and current.name.startswith(PREFIX):
                label = current
                nearer = nearer or "label"
            if node is None and current.name.startswith(BACKWARD):
                node = current
                nearer = nearer or "node"
            current = current.cpu_parent
        return label, node, nearer

    part_of_sequence = {}
    # in start order, so that of the ops sharing a sequence number (those that make no node take the next one's)
    # the last, the one that made the node, decides
    for event in sorted(cpu, key=lambda e: e.time_range.start):
        if event.sequence_nr < 0 or event.name.startswith(BACKWARD):
            continue
        label, _, nearer = enclosing(event)
        if nearer == "label":
            part_of_sequence[event.thread, event.sequence_nr] = label.name[len(PREFIX):]
    parts = defaultdict(lambda: {"forward": 0.0, "recompute": 0.0, "backward": 0.0})
    claimed = 0.0
    for event in cpu:
        seconds = _own_seconds(event, on_cuda)
        if seconds <= 0:
            continue
        claimed += seconds
        label, node, nearer = enclosing(event)
        if nearer == "label":
            parts[label.name[len(PREFIX):]]["recompute" if node is not None else "forward"] += seconds
        elif nearer == "node":
            part = part_of_sequence.get((node.fwd_thread, node.sequence_nr), "other")
            parts[part]["backward"] += seconds
        else:
            parts["other"]["forward"] += seconds
    result = {part: dict(phases) for part, phases in sorted(parts.items())}
    if on_cuda:
        total = sum(_own_seconds(e, True) for e in events if is_kernel(e))
        result["unattributed"] = {"forward": max(total - claimed, 0.0), "recompute": 0.0, "backward": 0.0}
        result["total"] = total
    return result


def table(parts: dict, tokens: int | None = None) -> str:
    """Rows ``part: forward / recompute / backward / sum`` in seconds (and microseconds per token)."""
    lines = []
    for part, phases in parts.items():
        if not isinstance(phases, dict):
            continue
        total = sum(phases.values())
        per_token = f", {total / tokens * 1e6:8.2f} us/token" if tokens else ""
        lines.append(f"  {part:17s} fwd {phases['forward']:8.3f}  recompute {phases['recompute']:8.3f}  "
                     f"bwd {phases['backward']:8.3f}  sum {total:8.3f} s{per_token}")
    return "\n".join(lines)
