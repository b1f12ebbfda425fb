"""Opaque identity ops that fix what a compiled call on the traced host path
(:func:`gdn_kcp.trace_host_path`) keeps for its backward and what its
backward recomputes:

- ``gdn_kcp::forward_boundary``: o, the final states and the saved set (the
  tensors of ``gdn_saved_layout_kcp``) as one node's outputs;
- ``gdn_kcp::replay_boundary``: what the backward reads of the forward (its
  inputs, index tables and saved set), through a node that also takes the
  backward's incoming gradients.

Why. On the traced path every program decomposes into aten nodes, and what
crosses from the compiled forward to its backward is the min-cut
partitioner's choice. A light backward replays prep from q, k, v, g, beta:
in AOT autograd's joint graph those replayed nodes are the forward's nodes
again, its CSE pass merges them, and the partitioner keeps prep's products (A's
chunk blocks, W, U, v_new) as activations: 876,176 B at T = 512 in three
documents, H_qk = 1, HV = 2, K = V = 32, fp32, where the saved layout says 0.
With the backward's reads behind ``replay_boundary`` every replayed node
depends on a gradient, so it is neither merged with a forward node nor moved
into the forward (the zeros and masks the programs make from no input are
kept apart by turning the joint CSE off in the block:
:func:`gdn_kcp.ops.autograd.joint_cse_off`). Behind ``forward_boundary`` the
saved set is kept as it is: the partitioner never recomputes forward work
that is a custom op (not in its allowlist), nor saves a part of one; and o
is one node: a model that reads it after the call (an output projection)
keeps o itself, not some intermediate of the walk, and a selective-checkpoint
policy can save o and the saved set (:func:`gdn_kcp.checkpoint_policy`:
without it a checkpointed region whose o is read after it ran scores, the walk
with the output and a second prep again in its backward; tagging
``walk_output`` saved its intermediates too). What a compiled forward keeps
of GDN is then its inputs, the index tables, o and the saved layout, whatever
the partitioner's heuristics or the model around the call
(tests/test_compiled_saved.py).

Inductor lowers both ops to their inputs (:func:`lower_boundaries_away`):
no copy, no call; under ``aot_eager`` they are copies. Eager calls, and the
opaque ops, have none of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

BOUNDARY_OPS = frozenset({"forward_boundary", "replay_boundary"})
"""The ops' names: identities that run no program (a graph that calls only
these and the exchanges still runs every program as its own kernels)."""


@torch.library.custom_op("gdn_kcp::forward_boundary", mutates_args=())
def forward_boundary(tensors: list[Tensor]) -> list[Tensor]:
    """o ``[T, HV, V]``, the final states and the saved tensors, each as a
    tensor of its own (an opaque op must not return its input). One node
    that also makes o: the partitioner counts it as forward work, which it
    never recomputes (a custom op is not in its allowlist) and whose outputs
    it keeps as they are (an op that made only the saved set would feed no
    forward output, and the partitioner may move such a node into the
    backward)."""
    return [x.clone() for x in tensors]


@forward_boundary.register_fake
def _forward_boundary_fake(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(x) for x in tensors]


forward_boundary.register_autograd(lambda ctx, grads: list(grads))


@torch.library.custom_op("gdn_kcp::replay_boundary", mutates_args=())
def replay_boundary(tensors: list[Tensor], after: list[Tensor]) -> list[Tensor]:
    """``tensors`` (what a backward reads of its forward), each as a tensor of
    its own that depends on ``after`` (the backward's incoming gradients), so
    nothing computed from them is the forward's work."""
    return [x.clone() for x in tensors]


@replay_boundary.register_fake
def _replay_boundary_fake(tensors: list[Tensor], after: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(x) for x in tensors]


def _replay_boundary_setup(ctx, inputs, output):
    ctx.n_after = len(inputs[1])


def _replay_boundary_backward(ctx, grads):
    return list(grads), [None] * ctx.n_after


replay_boundary.register_autograd(_replay_boundary_backward, setup_context=_replay_boundary_setup)


def lower_boundaries_away() -> None:
    """Register Inductor's lowerings of the boundary ops: their inputs
    themselves (as Inductor lowers ``aten.alias``), no copy and no call in the
    output code. Inductor's registry is private: if it cannot be reached,
    Inductor keeps each op as a fallback call, a copy (correct, slower)."""
    try:
        from torch._inductor.lowering import lowerings, register_lowering
    except Exception:  # a torch without that registry: the fallback copies
        return
    ops = torch.ops.gdn_kcp
    for op, lowering in ((ops.forward_boundary.default, lambda tensors: list(tensors)),
                         (ops.replay_boundary.default, lambda tensors, after: list(tensors))):
        if op not in lowerings:
            register_lowering(op, type_promotion_kind=None)(lowering)
