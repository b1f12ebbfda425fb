"""``gdn_kcp::output_boundary``: the traced host path's o as one node that a
selective-checkpoint policy can save.

On the traced host path (:func:`gdn_kcp.trace_host_path`) o is the last write
of the walk's (or the output program's) decomposition: hundreds of aten nodes,
which a checkpoint policy can only tag all alike. Under Inductor's
partitioner, a checkpointed region whose o is read after it in the same graph
then runs scores, the walk with the output (all 15 of its matmuls) and a second
prep again in the backward: 1272 backward nodes against 974 with o saved
(``tests/checkpoint_cases.py``'s shapes). Tagging ``walk_output``
``MUST_SAVE`` stops that but saves its intermediates too, and the partitioner
then moves part of the backward's replay into the forward (saved bytes
378,913 against 166,432 with o alone). The compiled forward passes o through
this op instead, so ``gdn_kcp.checkpoint_policy()`` saves exactly o.

Only a call that Dynamo traces inside a checkpointed region has the op
(:func:`in_checkpoint_region`); every other graph is as it was. Under
``aot_eager`` it is a copy of o; Inductor lowers it to its input
(:func:`lower_output_boundary_away`), no copy and no call.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("gdn_kcp::output_boundary", mutates_args=())
def output_boundary(o: Tensor) -> Tensor:
    """o ``[T, HV, V]`` as a tensor of its own (an opaque op must not return its input)."""
    return o.clone()


@output_boundary.register_fake
def _output_boundary_fake(o: Tensor) -> Tensor:
    return torch.empty_like(o)


output_boundary.register_autograd(lambda ctx, grad: grad)


@torch.compiler.assume_constant_result
def in_checkpoint_region() -> bool:
    """While Dynamo traces: whether the call is inside the body of a
    ``torch.utils.checkpoint`` (its ``tag_activation_checkpoint`` subgraph),
    read from Dynamo's stack of subgraph tracers at trace time (a constant of
    the graph). Those are private: on any lookup error the answer is False
    and the region recomputes o as before."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        checkpoint_op = torch.ops.higher_order.tag_activation_checkpoint
        return any(getattr(tracer, "source_target", None) is checkpoint_op
                   for tracer in InstructionTranslator.current_tx().output.tracers)
    except Exception:
        return False


def lower_output_boundary_away() -> None:
    """Register Inductor's lowering of ``gdn_kcp::output_boundary``: its input
    itself (as Inductor lowers ``aten.alias``), no copy and no call in the output
    code. Inductor's registry is private: if it cannot be reached, Inductor
    keeps the op as a fallback call, a copy of o (correct, slower)."""
    try:
        from torch._inductor.lowering import lowerings, register_lowering
    except Exception:  # a torch without that registry: the fallback copy
        return
    op = torch.ops.gdn_kcp.output_boundary.default
    if op not in lowerings:
        register_lowering(op, type_promotion_kind=None)(lambda o: o)
