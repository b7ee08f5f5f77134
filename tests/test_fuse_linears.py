"""train.compile_train's graph pass: bias-free linears that read the same input become one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedagent.train.fuse_linears import FuseSharedInputLinears, fuse_shared_input_linears


class Block(torch.nn.Module):
    """q/k/v of one input (different widths), a biased linear of it (left alone), and gate/up of
    another input; a lone linear at the end (left alone)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in (("q", (8, 6)), ("k", (4, 6)), ("v", (4, 6)), ("b", (3, 6)), ("gate", (10, 6)),
                            ("up", (10, 6)), ("down", (6, 10))):
            setattr(self, name, torch.nn.Parameter(torch.randn(*shape, generator=g)))
        self.bias = torch.nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x):
        q, k, v = F.linear(x, self.q), F.linear(x, self.k), F.linear(x, self.v)
        biased = F.linear(x, self.b, self.bias)
        h = x + torch.cat([q[..., :2] * k[..., :2], v], dim=-1)
        mlp = F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)
        return mlp, biased


def _traced(model):
    gm = torch.fx.symbolic_trace(model)
    for node in gm.graph.nodes:   # what Dynamo's graphs carry: the weights' example values
        if node.op == "get_attr":
            node.meta["example_value"] = getattr(model, node.target)
    return gm


def _linears(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear)]


def test_shared_input_linears_become_one_with_the_same_values_and_gradients():
    model = Block()
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    names = [n for n, _ in model.named_parameters()]
    want = model(x)
    grads_want = torch.autograd.grad(sum(t.sum() for t in want), [x, *(getattr(model, n) for n in names)])
    gm = _traced(model)
    assert len(_linears(gm)) == 7
    assert fuse_shared_input_linears(gm.graph) == 3          # k, v into q's; up into gate's
    gm.recompile()
    assert len(_linears(gm)) == 4                           # qkv, the biased one, gate/up, down
    got = gm(x)
    grads_got = torch.autograd.grad(sum(t.sum() for t in got), [x, *(getattr(gm, n) for n in names)])
    # The same sums, blocked differently by the wider matmul: equal up to fp32 rounding.
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    for a, b in zip(grads_want, grads_got):                 # each weight keeps its own gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_the_pass_is_cacheable_and_takes_a_graph_module():
    gm = _traced(Block())
    p = FuseSharedInputLinears()
    assert p.uuid() == FuseSharedInputLinears().uuid()      # inductor's FX cache keys on it
    p(gm)                                                   # a GraphModule or its Graph
    gm.recompile()
    assert len(_linears(gm)) == 4
