"""``train.compile_train``'s graph pass: linears that read the same input become one matmul.

A decoder layer's q/k/v projections read the same normed hidden states, and so do the MLP's
gate and up projections. Run as three (two) GEMMs, each reads the activations again and the
narrow ones (SmolLM2's k and v: 576 → 192 over 32 768 tokens) are too small to keep an H200
busy; the backward pays the same again for the input's gradient. Here they become one
``linear`` over the concatenated weights, split back on the last dimension, so each is one
wider GEMM forward and two backward. The weights stay separate parameters (the concatenation
is part of the graph, so their gradients come out split) and nothing about the model or its
checkpoint changes.

It runs as inductor's ``pre_grad_custom_pass`` (torch IR, before autograd is traced), so it
is a :class:`torch._inductor.custom_graph_pass.CustomGraphPass` with a ``uuid`` (the hash of
this file) and compiled graphs stay cacheable across jobs. torch's own ``batch_linear_lhs``
fusion does the same for 2-D inputs only; a decoder's are 3-D.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
COUNTER = "fedagent_fused_linears"    # torch._dynamo.utils.counters["inductor"][COUNTER]: linears folded


def _bias_free_linear(node: torch.fx.Node):
    """(input, weight) of ``linear(input, weight)`` with no bias; None for any other node."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    inp = node.kwargs.get("input", args[0])
    weight = node.kwargs.get("weight", args[1])
    bias = node.kwargs.get("bias", args[2])
    if bias is not None or not isinstance(inp, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
        return None
    shape = getattr(weight.meta.get("example_value"), "shape", None)
    if shape is None or len(shape) != 2:
        return None
    return inp, weight


def fuse_shared_input_linears(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place; the number of linears folded into another's matmul."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[torch.fx.Node, list[tuple[torch.fx.Node, torch.fx.Node]]] = {}
    for node in graph.nodes:
        found = _bias_free_linear(node)
        if found is not None:
            groups.setdefault(found[0], []).append((node, found[1]))
    folded = 0
    for inp, members in groups.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda m: order[m[0]])
        head = members[0][0]
        # Every weight must exist before the first linear: graph inputs do, and a get_attr
        # (no inputs of its own) is moved there; a weight computed later stays out.
        members = [(n, w) for n, w in members if order[w] < order[head] or w.op == "get_attr"]
        if len(members) < 2 or members[0][0] is not head:
            continue
        weights = [w for _, w in members]
        for w in weights:
            if order[w] > order[head]:
                head.prepend(w)
        sizes = [int(w.meta["example_value"].shape[0]) for w in weights]
        with graph.inserting_before(head):
            cat = graph.call_function(torch.cat, (weights,), {"dim": 0})
            fused = graph.call_function(torch._C._nn.linear, (inp, cat))
            parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
            outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(members))]
        for out, (node, _) in zip(outs, members):
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        folded += len(members) - 1
    return folded


class FuseSharedInputLinears(CustomGraphPass):
    """:func:`fuse_shared_input_linears` as an inductor pass (cache key: this file's hash)."""

    def __call__(self, graph) -> None:
        from torch._dynamo.utils import counters

        counters["inductor"][COUNTER] += fuse_shared_input_linears(graph.graph if hasattr(graph, "graph") else graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
