"""Process groups: which group a KCP split runs on (the forms a caller may
pass), which device its collectives move tensors on, and the digest the
ranks compare facts by."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

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


def group_device(group: object) -> torch.device:
    """CUDA when the group can move CUDA tensors (an NCCL backend, alone or in a
    "cpu:gloo,cuda:nccl" pair), else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def digest(value: object) -> int:
    """48 bits of sha256 of ``repr(value)``: equal values share it, and it is
    exact in an int64 or fp64 column of a collective."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "little")
