"""Data x context parallel training on a 2 x 2 DeviceMesh of gloo ranks
(``dp`` x ``cp``): a small LM of GatedDeltaNet layers, the one-process run it
must equal, and the rank functions of tests/test_training_stacks.py.

Each dp group trains on its own packed stream (a batch); its two cp ranks
split that stream at a token boundary, with one document crossing. The loss
is the mean next-token loss over every target of every stream, so the
step's gradient is the sum of every rank's share: FSDP2 (or DDP) over all four
ranks averages, and each rank scales its share by the world size.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gdn_kcp import build_kcp_context, check_cp_gradients
from gdn_kcp.layers import GatedDeltaNet

HIDDEN, VOCAB, STEPS, LR = 16, 32, 3, 1e-2
STREAMS = [[0, 30, 100, 130], [0, 90, 130]]
"""Document bounds of the two dp groups' streams (T = 130; split 65 / 65)."""
MAX_DOCS = 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            GatedDeltaNet(hidden_size=HIDDEN, head_dim=8, num_heads=2, num_v_heads=4) for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, **where) -> torch.Tensor:
        x = self.embed(tokens)[None]
        for layer in self.layers:
            x = x + layer(x, **where)[0]
        return self.head(x[0])


def make_model() -> TinyLM:
    torch.manual_seed(0)  # the same initial weights in every process
    return TinyLM().double()


def stream_tokens(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STREAMS[i][-1],), generator=torch.Generator().manual_seed(10 + i))


def targets(tokens: torch.Tensor, bounds: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets of the global positions ``[start, end)`` and whether
    each lies in the same document (labels are sliced from the whole stream)."""
    positions = torch.arange(start, end)
    doc_ends = torch.tensor(bounds[1:])
    valid = positions + 1 < doc_ends[torch.searchsorted(doc_ends, positions, right=True)]
    return tokens[(positions + 1).clamp(max=len(tokens) - 1)], valid


def n_targets() -> int:
    return sum(int(targets(stream_tokens(i), b, 0, b[-1])[1].sum()) for i, b in enumerate(STREAMS))


def loss_share(model: nn.Module, tokens, bounds, start, end, **where) -> torch.Tensor:
    """The summed loss of the targets in ``[start, end)``, over every target."""
    logits = model(tokens[start:end], **where)
    labels, valid = targets(tokens, bounds, start, end)
    return (F.cross_entropy(logits, labels, reduction="none") * valid).sum() / n_targets()


def one_process_run() -> list[list[torch.Tensor]]:
    """Parameters after each step of the one-process run on both streams."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    history = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = sum(loss_share(model, stream_tokens(i), b, 0, b[-1], cu_seqlens=torch.tensor(b))
                   for i, b in enumerate(STREAMS))
        loss.backward()
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def mesh_2x2():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))


def shard(model: nn.Module, mesh, wrapping: str) -> nn.Module:
    """``fsdp``: FSDP2 over the flattened dp x cp mesh (the recipe);
    ``ddp``: DDP over every rank; ``fsdp_dp_only`` / ``ddp_dp_only``: over dp
    alone (the mistakes)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if wrapping == "ddp":
        return DistributedDataParallel(model)
    if wrapping == "ddp_dp_only":
        return DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if wrapping == "fsdp" else mesh["dp"]
    for layer in model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


def train_on_mesh(wrapping: str, check_every_step: bool) -> list[list[torch.Tensor]]:
    """Parameters (whole) after each step on this rank."""
    mesh = mesh_2x2()
    dp = mesh.get_local_rank("dp")
    model = shard(make_model(), mesh, wrapping)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    bounds, tokens = STREAMS[dp], stream_tokens(dp)
    ctx = build_kcp_context(bounds, (mesh, "cp"), max_docs=MAX_DOCS)
    start, end = ctx.rank_ranges[ctx.rank]
    world = dist.get_world_size()
    history = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        # each rank's share of the global mean, times the world size the wrapper averages over
        (world * loss_share(model, tokens, bounds, start, end, kcp_context=ctx)).backward()
        if check_every_step:
            check_cp_gradients(model, mesh["cp"])
        optimizer.step()
        history.append([p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach().clone()
                        for p in model.parameters()])
    return history


def check_recipes(rank: int, R: int, expected: list[list[torch.Tensor]]) -> None:
    """FSDP2 over the flattened mesh and DDP over every rank equal the one-process
    run after each step (fp64, 1e-9), and pass the gradient check."""
    for wrapping in ("fsdp", "ddp"):
        history = train_on_mesh(wrapping, check_every_step=True)
        for step, (params, want) in enumerate(zip(history, expected)):
            for i, (a, b) in enumerate(zip(params, want)):
                gap = float((a - b).abs().max())
                assert gap < 1e-9, (wrapping, rank, step, i, gap)


def check_mistake_is_caught(rank: int, R: int) -> None:
    """FSDP2 or DDP over dp alone: the check raises on every rank, naming parameters."""
    for wrapping, prefix in (("fsdp_dp_only", ""), ("ddp_dp_only", "module.")):
        try:
            train_on_mesh(wrapping, check_every_step=True)
        except ValueError as err:
            message = str(err)
            assert "context-parallel ranks hold different gradients of" in message, message
            assert f"{prefix}layers.0.q_proj.weight" in message and "relative difference" in message, message
            assert "_flatten('dp_cp')" in message, message
        else:
            raise AssertionError(f"{wrapping} trained without an error")


def check_gradient_check_cases(rank: int, R: int) -> None:
    """check_cp_gradients on two ranks of the default group: a gradient on one
    rank only, a gap below and above rtol, and modules that differ."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    model.weight.grad = torch.ones(3, 4, dtype=torch.float64) * (1 + 1e-7 * rank)  # sum of squares: 2e-7 apart
    model.bias.grad = torch.ones(3, dtype=torch.float64) if rank == 0 else None
    expect_error(lambda: check_cp_gradients(model, None), r"bias \(a gradient on some ranks, none on others\)")
    model.bias.grad = torch.ones(3, dtype=torch.float64)
    check_cp_gradients(model, None)  # 1e-7 apart: within the default rtol of 1e-5
    expect_error(lambda: check_cp_gradients(model, None, rtol=1e-9), r"of weight \(relative difference 2e-07\)")
    expect_error(lambda: check_cp_gradients(model, None, rtol=-1.0), "rtol must be a float >= 0")
    other = nn.Linear(4, 3) if rank == 0 else nn.Sequential(nn.Linear(4, 3))
    for p in other.parameters():
        p.grad = torch.zeros_like(p)
    expect_error(lambda: check_cp_gradients(other, None), "name different parameters")
    extra = nn.Linear(4, 3, bias=rank == 0)
    expect_error(lambda: check_cp_gradients(extra, None), r"different numbers of parameters \[2, 1\]")


def expect_error(call, pattern: str) -> None:
    try:
        call()
    except ValueError as err:
        assert re.search(pattern, str(err)), (pattern, str(err))
    else:
        raise AssertionError(f"no ValueError matching {pattern!r}")


def check_group_forms(rank: int, R: int) -> None:
    """build_kcp_context and check_cp_gradients take a ProcessGroup, a 1-D
    mesh or a (mesh, name) pair, and name what they take otherwise."""
    mesh = mesh_2x2()
    bounds = STREAMS[mesh.get_local_rank("dp")]
    contexts = [build_kcp_context(bounds, group) for group in (mesh["cp"].get_group(), mesh["cp"], (mesh, "cp"))]
    for ctx in contexts:
        assert (ctx.R, ctx.rank, ctx.group_name) == (2, mesh.get_local_rank("cp"), mesh["cp"].get_group().group_name)
    errors = [
        (TypeError, "group must be None, a ProcessGroup, a 1-D DeviceMesh or a", "cp"),
        (TypeError, "group must be None", (mesh, 1)),
        (ValueError, r"2-D DeviceMesh \('dp', 'cp'\): pass \(mesh, dim_name\)", mesh),
        (ValueError, "the mesh has no dimension 'tp'", (mesh, "tp")),
    ]
    for error, message, group in errors:
        for call in (lambda: build_kcp_context(bounds, group), lambda: check_cp_gradients(nn.Linear(1, 1), group)):
            try:
                call()
            except error as err:
                assert re.search(message, str(err)), (message, str(err))
            else:
                raise AssertionError(f"group={group!r} was taken")
