"""What a CuTe program compiles to, read on the CPU: its PTX's warpgroup MMAs,
its SASS's HGMMAs, and the registers, stack and local memory (spills) ptxas
gave it, read off the cubin by ``cuobjdump -res-usage``. docs/cute.md's table
holds these for :data:`CHECKED_CASES` (tests/test_cute_compile.py ties it).

    python -m gdn_kcp.kernels.cute.compile_facts            # the table's rows, sm_90a
    python -m gdn_kcp.kernels.cute.compile_facts sm_100a    # the same source for Blackwell
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..chunk_index import ChunkIndex, CHUNK_SIZE

CHECKED_CASES = tuple((program, dtype, D) for program in ("scores", "w_u")
                      for dtype in (torch.bfloat16, torch.float16) for D in (128, 64))
"""(program, input dtype, K = V): the compiled shapes the table and the CPU checks hold."""
CASE_T, CASE_H_QK, CASE_HV = 256, 2, 4
"""The static sizes a check compiles at (T and the chunk count are symbolic: any value gives the same code)."""


@dataclass(frozen=True)
class CompileFacts:
    program: str
    dtype: str
    head_dim: int
    arch: str
    registers: int
    stack_bytes: int
    local_bytes: int
    wgmma: tuple[str, ...]  # the PTX's distinct warpgroup MMA instructions
    wgmma_count: int
    hgmma_count: int | None  # None: no cuobjdump to disassemble with
    seconds: float


def meta_launch(program: str, dtype: torch.dtype, D: int, *, l2: bool = True):
    """The program's :class:`~gdn_kcp.kernels.cute.launch.Launch` on meta
    tensors of the twin's buffer shapes (q, k ``[T, H_qk, K]``, v, w, u
    ``[T, HV, D]``, g, beta ``[T, HV]``, A and scores ``[T, HV, 64]``, norms
    ``[T, H_qk]`` fp32)."""
    import importlib

    T, H_qk, HV = CASE_T, CASE_H_QK, CASE_HV
    index = ChunkIndex.from_fragments([0, 100, T], device="meta")

    def new(*shape, dt=dtype):
        return torch.empty(shape, dtype=dt, device="meta")
    rstd = new(T, H_qk, dt=torch.float32) if l2 else None
    if program == "scores":
        module = importlib.import_module("gdn_kcp.kernels.cute.scores")
        return module.plan(new(T, H_qk, D), new(T, H_qk, D), new(T, HV), index, q_rstd=rstd, k_rstd=rstd,
                           scores_out=new(T, HV, CHUNK_SIZE))
    if program == "w_u":
        module = importlib.import_module("gdn_kcp.kernels.cute.w_u")
        return module.plan(new(T, H_qk, D), new(T, HV, D), new(T, HV), new(T, HV), new(T, HV, CHUNK_SIZE), index,
                           k_rstd=rstd, w_out=new(T, HV, D), u_out=new(T, HV, D))
    raise ValueError(f"program must be 'scores' or 'w_u', got {program!r}")


def cuobjdump() -> str | None:
    """A cuobjdump: the CUDA wheel's (nvidia-cuda-cuobjdump), Triton's, or one on PATH."""
    import site

    for root in [*site.getsitepackages(), site.getusersitepackages()]:
        for rel in ("nvidia/cu13/bin/cuobjdump", "nvidia/cuda_cuobjdump/bin/cuobjdump",
                    "triton/backends/nvidia/bin/cuobjdump"):
            if (Path(root) / rel).exists():
                return str(Path(root) / rel)
    return shutil.which("cuobjdump")


def resource_usage(cubin: Path, tool: str) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's kernel (``cuobjdump -res-usage``)."""
    text = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def compile_facts(program: str, dtype: torch.dtype, D: int, arch: str = "sm_90a") -> CompileFacts:
    """Compile ``program`` for ``arch`` at (dtype, K = V = D) and read its facts."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .launch import fake_arguments

    launch = meta_launch(program, dtype, D)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        compiled = cute.compile(launch.program, *fake_arguments(launch), make_fake_stream(),
                                options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {folder}")
        seconds = time.perf_counter() - start
        ptx = compiled.__ptx__
        cubin = Path(folder) / "program.cubin"
        cubin.write_bytes(compiled.__cubin__)
        tool = cuobjdump()
        usage = resource_usage(cubin, tool) if tool else {}
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout if tool else None
    wgmma = re.findall(r"wgmma\.mma_async[\w.]*", ptx)
    return CompileFacts(program, str(dtype).removeprefix("torch."), D, arch, usage.get("REG", -1),
                        usage.get("STACK", -1), usage.get("LOCAL", -1), tuple(sorted(set(wgmma))), len(wgmma),
                        None if sass is None else len(re.findall(r"\bHGMMA\.", sass)), round(seconds, 2))


def table_row(f: CompileFacts) -> str:
    """The fact's row of docs/cute.md's table."""
    shapes = ", ".join(sorted({re.search(r"m\d+n\d+k\d+", w).group(0) for w in f.wgmma})) or "none"
    return (f"| {f.program} | {f.dtype} | {f.head_dim} | {f.registers} | {f.local_bytes} | {f.stack_bytes} | "
            f"{shapes} | {f.wgmma_count} | {f.hgmma_count} |")


def main(argv: list[str]) -> None:
    arch = argv[0] if argv else "sm_90a"
    for program, dtype, D in CHECKED_CASES:
        try:
            facts = compile_facts(program, dtype, D, arch)
        except Exception as error:  # the sm_100a report prints what failed, row by row
            print(f"| {program} | {dtype} | {D} | failed: {type(error).__name__}: {str(error)[:200]} |")
            continue
        print(table_row(facts), f"({facts.seconds} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
