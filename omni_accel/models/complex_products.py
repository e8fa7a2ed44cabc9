"""An inductor graph pass: products of complex tensors computed as real arithmetic, so that they fuse.

Several Diffusers families rotate q and k by complex multiplication (Qwen-Image, Z-Image, Qwen-Image 2.1,
NucleusMoE, AnyFlow, Wan-Animate 2, Bria FIBO 2, SANA-WM: ``view_as_real(view_as_complex(x) * freqs)``).
Inductor generates no code for complex tensors, so each such product runs as a separate eager kernel
between fused ones, in Diffusers' own ``compile_repeated_blocks`` as in ours (a compiled Qwen-Image forward
runs over a hundred of them: docs/archive/performance-history.md). This pass rewrites each
``view_as_real(a * b)`` of complex ``a`` and ``b`` as ``stack((ar*br - ai*bi, ar*bi + ai*br), -1)`` over
their real views, which inductor fuses with the norm before it and the cast after it. The same products in
the same precision; only the rounding of the fused order can differ, as anywhere in compiled code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten


class RealComplexProducts(CustomGraphPass):
    """``post_grad_custom_pre_pass`` of our block compiles (see the module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target is aten.view_as_real.default and _complex_product(node.args[0]):
                product = node.args[0]
                with graph.inserting_before(node):
                    node.replace_all_uses_with(_real_product(graph, *product.args))
                graph.erase_node(node)
                if not product.users:
                    graph.erase_node(product)
        graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _complex_product(node: Any) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.target is aten.mul.Tensor
        and all(_is_complex(arg) for arg in node.args)
    )


def _is_complex(node: Any) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.is_complex()


def _real_product(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
    (ar, ai), (br, bi) = _parts(graph, a), _parts(graph, b)
    real = _call(
        graph, aten.sub.Tensor, _call(graph, aten.mul.Tensor, ar, br), _call(graph, aten.mul.Tensor, ai, bi)
    )
    imag = _call(
        graph, aten.add.Tensor, _call(graph, aten.mul.Tensor, ar, bi), _call(graph, aten.mul.Tensor, ai, br)
    )
    # stack() as the decomposed graph spells it (this pass runs after decomposition)
    parts = [_call(graph, aten.unsqueeze.default, part, -1) for part in (real, imag)]
    return _call(graph, aten.cat.default, parts, -1)


def _parts(graph: torch.fx.Graph, node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The real and imaginary parts of complex ``node``, read from its real view."""
    real = _real_view(graph, node)
    return _call(graph, aten.select.int, real, -1, 0), _call(graph, aten.select.int, real, -1, 1)


def _real_view(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """``view_as_real(node)``, without a complex tensor where ``node`` is a view of a real one: a
    ``view_as_complex`` (its input), an ``unsqueeze`` of a complex tensor (the unsqueeze of its real view)."""
    if node.target is aten.view_as_complex.default:
        return node.args[0]
    if node.target is aten.unsqueeze.default:
        source, dim = node.args
        ndim = source.meta["val"].dim()
        return _call(graph, aten.unsqueeze.default, _real_view(graph, source), dim % (ndim + 1))
    return _call(graph, aten.view_as_real.default, node)


def _call(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A new node with the fake value inductor's lowering reads (``meta["val"]``)."""
    node = graph.call_function(target, args)
    values = torch.fx.node.map_arg(args, lambda arg: arg.meta["val"])
    fake = next(v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)).fake_mode
    with fake:
        node.meta["val"] = target(*values)
    return node
