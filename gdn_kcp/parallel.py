"""Training stacks: which process group a KCP split runs on, and the one check
that data x context parallel training sums its gradients over the context ranks.

A KCP rank computes only its own tokens' share of every parameter gradient, so
the step's gradient is the sum over the context-parallel (cp) ranks as well as
over the data-parallel ones. FSDP2 or DDP over the flattened dp x cp ranks
does that sum; FSDP2 over the dp ranks alone does not, and trains on with
gradients that differ from rank to rank of a cp group (on a 2 x 2 mesh, off by
a relative 0.75 in the first step). :func:`check_cp_gradients`, called once
after a backward, turns that silence into an error.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

GROUP_FORMS = "None, a ProcessGroup, a 1-D DeviceMesh or a (DeviceMesh, dim_name) pair"


def _is_mesh(x: object) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(x, DeviceMesh)


def resolve_group(group: object, name: str = "group") -> object:
    """The process group of ``group``: None (the default group), a
    ``ProcessGroup``, a 1-D ``DeviceMesh`` or a ``(mesh, "cp")`` pair naming
    the context-parallel dimension of a larger mesh. Anything else is a
    ``TypeError`` naming what it takes."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    if _is_mesh(group):
        if group.ndim != 1:
            raise ValueError(
                f"{name} is a {group.ndim}-D DeviceMesh {tuple(group.mesh_dim_names or ())}: pass "
                f"(mesh, dim_name) naming its context-parallel dimension, e.g. (mesh, 'cp'), or mesh['cp']"
            )
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and _is_mesh(group[0]) and isinstance(group[1], str):
        mesh, dim = group
        names = tuple(mesh.mesh_dim_names or ())
        if dim not in names:
            raise ValueError(f"{name} = (mesh, {dim!r}): the mesh has no dimension {dim!r}; its dimensions are {names}")
        return mesh.get_group(dim)
    raise TypeError(f"{name} must be {GROUP_FORMS}, got {type(group).__name__} {group!r}")


REDUCED, NO_GRADIENT = -1, -2
"""Placement codes of a parameter not compared: its gradient is a DTensor
reduced over every rank of the group by its own collective, or there is none."""


def _digest(value: object) -> int:
    """48 bits of sha256 of ``repr(value)``: exact in an fp64 or int64 column."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "little")


def group_device(group: object) -> torch.device:
    """CUDA when the group can move CUDA tensors (an NCCL backend, alone or in a
    "cpu:gloo,cuda:nccl" pair), else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """``[sum, sum |g|, sum g^2]`` in fp64: equal gradients give equal prints,
    and a share of a sum (one rank's tokens) gives different ones."""
    flat = grad.detach().reshape(-1).to(torch.float64)
    return torch.stack([flat.sum(), flat.abs().sum(), flat.square().sum()])


def _placement(grad: torch.Tensor | None, members: set[int]) -> int:
    """Which piece of the parameter this rank's gradient is, as a digest of
    its mesh coordinate and local shape; ``REDUCED`` for a DTensor whose mesh
    holds every rank of the group, ``NO_GRADIENT`` for none."""
    if grad is None:
        return NO_GRADIENT
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return _digest(("whole", tuple(grad.shape)))
    if members <= set(mesh.mesh.flatten().tolist()):
        return REDUCED
    return _digest((tuple(mesh.get_coordinate() or ()), tuple(grad.to_local().shape)))


def check_cp_gradients(module: nn.Module, group: object, *, rtol: float = 1e-5) -> None:
    """Raise a ``ValueError`` naming every parameter of ``module`` whose
    gradient differs across the ranks of the context-parallel ``group``.

    Call it once, after the first ``backward`` of a training run (and after
    any gradient reduction of your own): every rank of ``group`` must call it
    together (two all-gathers of a few numbers per parameter, one host sync).
    ``group`` takes the forms of :func:`gdn_kcp.build_kcp_context` (None for
    the default group, a ProcessGroup, a 1-D DeviceMesh such as
    ``mesh["cp"]``, or ``(mesh, "cp")``). A gradient that is a DTensor whose
    mesh holds every rank of ``group`` (FSDP2 over the flattened dp x cp mesh)
    was reduced over them by its own collective and is not compared; any
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
    names, codes, prints = [], [], []
    for name, param in module.named_parameters():
        grad = param.grad
        code = _placement(grad, members)
        names.append(name)
        codes.append([_digest(name), code])
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        prints.append(_fingerprint(local).cpu() if code >= 0 else torch.zeros(3, dtype=torch.float64))
    table = torch.cat([torch.tensor(codes, dtype=torch.float64).view(-1, 2),
                       torch.stack(prints) if prints else torch.zeros(0, 3, dtype=torch.float64)], dim=1)
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
    """Every rank's ``[n_params, 5]`` table (name digest, placement, print),
    on the group's device; a rank with other parameters than rank 0 is an error."""
    device = group_device(group)
    R = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(R)]
    dist.all_gather(counts, torch.tensor([table.shape[0]], dtype=torch.int64, device=device), group=group)
    sizes = [int(c) for c in counts]
    if len(set(sizes)) > 1:
        raise ValueError(f"check_cp_gradients: the ranks' modules hold different numbers of parameters {sizes}")
    gathered = [torch.zeros_like(table, device=device) for _ in range(R)]
    dist.all_gather(gathered, table.to(device), group=group)
    rows = [t.cpu().tolist() for t in gathered]
    if any([row[0] for row in rank] != [row[0] for row in rows[0]] for rank in rows):
        raise ValueError("check_cp_gradients: the ranks' modules name different parameters: pass the same model")
    return rows


def _differing(names: list[str], rows: list, rtol: float) -> list[tuple[str, str]]:
    """``(name, why)`` of each parameter whose gradients differ between ranks
    holding the same piece of it (every rank computes the same list)."""
    differ = []
    for i, name in enumerate(names):
        entries = [(int(rank[i][1]), rank[i][2:]) for rank in rows]
        codes = {code for code, _ in entries}
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
