"""Training stacks: the one check that data x context parallel training sums
its gradients over the context ranks.

A KCP rank computes only its own tokens' share of every parameter gradient, so
the step's gradient is the sum over the context-parallel (cp) ranks as well as
over the data-parallel ones. FSDP2 or DDP over the flattened dp x cp ranks
does that sum; FSDP2 over the dp ranks alone does not, and trains on with
gradients that differ from rank to rank of a cp group (on a 2 x 2 mesh, off by
a relative 0.75 in the first step). :func:`check_cp_gradients`, called once
after a backward, turns that silence into an error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gdn_kcp.groups import digest, group_device, resolve_group

REDUCED, NO_GRADIENT, UNREDUCED = -1, -2, -3
"""Placement codes of a parameter: its gradient is a DTensor that its own
collective reduced over every rank of the group (not compared), it has no
gradient, or it is a DTensor with a ``Partial`` placement (never reduced)."""


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """``[sum, sum |g|, sum g^2]`` in fp64: equal gradients give equal prints,
    and a share of a sum (one rank's tokens) gives different ones."""
    flat = grad.detach().reshape(-1).to(torch.float64)
    return torch.stack([flat.sum(), flat.abs().sum(), flat.square().sum()])


def _placement(grad: torch.Tensor | None, members: set[int]) -> int:
    """Which piece of the parameter this rank's gradient is, as a digest of
    its mesh coordinate and local shape, or one of the codes above. A DTensor
    sharded or replicated over a mesh that holds every rank of the group was
    reduced over them (FSDP2's reduce-scatter); one with a ``Partial``
    placement holds an unreduced share."""
    if grad is None:
        return NO_GRADIENT
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return digest(("whole", tuple(grad.shape)))
    if any(placement.is_partial() for placement in grad.placements):
        return UNREDUCED
    if members <= set(mesh.mesh.flatten().tolist()):
        return REDUCED
    return digest((tuple(mesh.get_coordinate() or ()), tuple(grad.to_local().shape)))


def check_cp_gradients(module: nn.Module, group: object, *, rtol: float = 1e-5) -> None:
    """Raise a ``ValueError`` naming every parameter of ``module`` whose
    gradient differs across the ranks of the context-parallel ``group``.

    Call it once, after the first ``backward`` of a training run (and after
    any gradient reduction of your own): every rank of ``group`` must call it
    together (two all-gathers of a few numbers per parameter, one host sync).
    ``group`` takes the forms of :func:`gdn_kcp.build_kcp_context` (None for
    the default group, a ProcessGroup, a 1-D DeviceMesh such as
    ``mesh["cp"]``, or ``(mesh, "cp")``). A gradient that is a DTensor sharded
    or replicated over a mesh holding every rank of ``group`` (FSDP2 over the
    flattened dp x cp mesh) was reduced over them by its own collective and is
    not compared; a DTensor with a ``Partial`` placement is an error; any
    other gradient must agree, piece by piece, on every rank of ``group``, to
    ``rtol`` of its magnitude (sum, absolute sum and sum of squares, in fp64).

    Example::

        mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
        fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))   # sums over cp too
        ...
        loss.backward()
        check_cp_gradients(model, mesh["cp"])    # raises under fully_shard(model, mesh=mesh["dp"])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0:
        raise ValueError(f"rtol must be a float >= 0, got {rtol!r}")
    group = resolve_group(group)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    members = set(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    device = group_device(group)
    names, codes, prints = [], [], []
    for name, param in module.named_parameters():
        grad = param.grad
        code = _placement(grad, members)
        names.append(name)
        codes.append([digest(name), code])
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        prints.append(_fingerprint(local).to(device) if code >= 0 else torch.zeros(3, dtype=torch.float64,
                                                                                 device=device))
    table = torch.cat([torch.tensor(codes, dtype=torch.float64, device=device).view(-1, 2),
                       torch.stack(prints) if prints else torch.zeros(0, 3, dtype=torch.float64, device=device)],
                      dim=1)
    rows = _gather_rows(table, group)
    differ = _differing(names, rows, rtol)
    if differ:
        listed = ", ".join(f"{name} ({why})" for name, why in differ[:8])
        more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
        raise ValueError(
            f"check_cp_gradients: the {len(rows)} context-parallel ranks hold different gradients of {listed}"
            f"{more}. Each cp rank computes only its own tokens' share of a gradient, so the gradients must be "
            f"summed over the cp ranks too: shard with FSDP2 over the flattened dp x cp mesh "
            f"(fully_shard(model, mesh=mesh['dp', 'cp']._flatten('dp_cp'))) or wrap with DDP over all ranks, "
            f"not over the dp ranks alone"
        )


def _gather_rows(table: torch.Tensor, group: object) -> list[list[list[float]]]:
    """Every rank's ``[n_params, 5]`` table (name digest, placement, print);
    a rank whose module holds other parameters than rank 0's is an error."""
    R = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=table.device) for _ in range(R)]
    dist.all_gather(counts, torch.tensor([table.shape[0]], dtype=torch.int64, device=table.device), group=group)
    sizes = torch.cat(counts).tolist()
    if len(set(sizes)) > 1:
        raise ValueError(f"check_cp_gradients: the ranks' modules hold different numbers of parameters {sizes}: "
                         f"pass the same model on every rank")
    gathered = [torch.zeros_like(table) for _ in range(R)]
    dist.all_gather(gathered, table, group=group)
    rows = torch.stack(gathered).tolist()  # a once-per-run check: this is its host sync
    if any([row[0] for row in rank] != [row[0] for row in rows[0]] for rank in rows):
        raise ValueError("check_cp_gradients: the ranks' modules name different parameters: pass the same model on "
                         "every rank")
    return rows


def _differing(names: list[str], rows: list, rtol: float) -> list[tuple[str, str]]:
    """``(name, why)`` of each parameter whose gradients differ between ranks
    holding the same piece of it (every rank computes the same list)."""
    differ = []
    for i, name in enumerate(names):
        entries = [(int(rank[i][1]), rank[i][2:]) for rank in rows]
        codes = {code for code, _ in entries}
        if UNREDUCED in codes:
            differ.append((name, "a DTensor gradient with a Partial placement: never reduced"))
            continue
        if NO_GRADIENT in codes and len(codes) > 1:
            differ.append((name, "a gradient on some ranks, none on others"))
            continue
        worst = 0.0
        for code in codes - {NO_GRADIENT, REDUCED}:
            same = [p for c, p in entries if c == code]
            worst = max([worst] + [_relative_gap(same[0], other) for other in same[1:]])
        if worst > rtol:
            differ.append((name, f"relative difference {worst:.2g}"))
    return differ


def _relative_gap(a: list[float], b: list[float]) -> float:
    """The largest gap of two fingerprints ``[sum, sum |g|, sum g^2]``: the
    first two relative to the larger absolute sum (a sum may cancel to 0),
    the last relative to itself."""
    scale = max(a[1], b[1], 1e-300)
    gaps = [abs(a[0] - b[0]) / scale, abs(a[1] - b[1]) / scale, abs(a[2] - b[2]) / max(a[2], b[2], 1e-300)]
    return max(gaps)
