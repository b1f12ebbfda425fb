"""flash-linear-attention's GDN chunk kernels as fla-core 0.5.1 launches them
on an H200, and their compile facts for sm_90 at every configuration of their
autotune lists (no GPU: ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``);
:data:`FLA_KDA_KERNELS` holds the same for 0.5.1's ``chunk_kda`` (KDA).

The calibration rows of ``benchmarks/roofline.py`` were measured with
fla-core 0.5.1, so this table follows 0.5.1's ``chunk_gated_delta_rule``
(``use_qk_l2norm_in_kernel=True``, ``cu_seqlens`` given, bf16, K = V = 128)
launch by launch, with the lists its autotuners hold on an H200 (Hopper, 227
KiB of shared memory per block: ``check_shared_mem`` true for every level,
tf32 for the triangular solve). On a machine without a GPU, fla evaluates
those lists for a CPU at import, so :func:`import_fla` sets the H200's device
flags in ``fla.utils`` before it imports a kernel module; it also skips the
package ``__init__`` files (they import modules that need einops, and one
whose autotune key triton 3.9 refuses), importing each kernel module alone.

Two facts about 0.5.1 on sm_90 the table records: its backward's
``chunk_bwd_kernel_dqkwg`` refuses to run on Hopper with triton >= 3.4 (a
correctness guard that sends it to a TileLang kernel, which 0.5.1 allows only
for H = HV), so the published backward times ran it under other conditions;
the model costs the Triton kernel, the one 0.5.1 ships. And the first call of
each autotuned kernel benchmarks its list: the measured times (CUDA graphs,
after warm-up) are of the configuration it picked, which the model takes to
be the least modelled time over the list.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

CHUNK = 64


def configs(**lists) -> list[dict]:
    """Every combination of the keyword lists, as autotune configurations
    (``num_warps`` and ``num_stages`` beside the constexprs)."""
    out = [{}]
    for name, values in lists.items():
        out = [{**c, name: v} for c in out for v in values]
    return out


L2_CONFIGS = configs(num_warps=[1, 2, 4, 8, 16], BT=[8, 16, 32, 64, 128], num_stages=[3])
CUMSUM_CONFIGS = configs(num_warps=[1, 2, 4, 8], num_stages=[3])
KKT_CONFIGS = configs(BK=[32, 64], num_warps=[1, 2, 4], num_stages=[3])
WU_CONFIGS = configs(num_warps=[2, 4, 8], num_stages=[2, 3, 4])
WALK_CONFIGS = configs(num_warps=[2, 4], num_stages=[2, 3, 4], BV=[32, 64])
O_CONFIGS = [dict(BK=128, BV=128, num_warps=8, num_stages=3), dict(BK=64, BV=64, num_warps=4, num_stages=3),
             dict(BK=32, BV=32, num_warps=2, num_stages=3)]
BWD_CONFIGS = configs(num_warps=[2, 4], num_stages=[2, 3, 4])  # Hopper's NUM_WARPS = [2, 4]

VARLEN = {"IS_VARLEN": True}


@dataclass(frozen=True)
class FlaKernel:
    """One kernel of the table: its module and ``@triton.jit`` function, its
    pointers (``name:dtype``; ``-`` for one passed as None), the constexprs
    the host passes, and its autotune list."""

    module: str
    function: str
    pointers: str
    constexprs: dict
    configs: list


FLA_KERNELS = {
    "l2norm_fwd_kernel": FlaKernel("fla.modules.l2norm", "l2norm_fwd_kernel", "x:bf16 y:bf16 rstd:fp32",
                                   {"D": 128, "BD": 128, "NB": 8}, L2_CONFIGS),
    "chunk_local_cumsum_scalar_kernel": FlaKernel(
        "fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel", "s:bf16 o:fp32",
        {"B": 1, "H": 32, "BT": CHUNK, "REVERSE": False, "HAS_SCALE": True, "HEAD_FIRST": False, **VARLEN},
        CUMSUM_CONFIGS),
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel": FlaKernel(
        "fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
        "k:bf16 g:fp32 beta:bf16 A:bf16", {"BT": CHUNK, "BC": 16, "USE_G": True, **VARLEN}, KKT_CONFIGS),
    "recompute_w_u_fwd_kernel": FlaKernel(
        "fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel",
        "k:bf16 v:bf16 beta:bf16 w:bf16 u:bf16 A:bf16 g:fp32",
        {"BT": CHUNK, "BK": 64, "BV": 64, "USE_G": True, **VARLEN}, WU_CONFIGS),
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": FlaKernel(
        "fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "k:bf16 v:bf16 w:bf16 v_new:bf16 g:fp32 gk:- h:bf16 h0:- ht:-",
        {"BT": CHUNK, "USE_G": True, "USE_GK": False, "USE_INITIAL_STATE": False, "STORE_FINAL_STATE": False,
         "SAVE_NEW_VALUE": True, "STATE_V_FIRST": False, **VARLEN}, WALK_CONFIGS),
    "chunk_fwd_kernel_o": FlaKernel(
        "fla.ops.common.chunk_o", "chunk_fwd_kernel_o", "q:bf16 k:bf16 v:bf16 h:bf16 g:fp32 g_gamma:- o:bf16",
        {"BT": CHUNK, "USE_G": True, "USE_G_GAMMA": False, "STATE_V_FIRST": False, **VARLEN}, O_CONFIGS),
    "chunk_bwd_kernel_dv_local": FlaKernel(
        "fla.ops.common.chunk_o", "chunk_bwd_kernel_dv_local", "q:bf16 k:bf16 g:fp32 g_gamma:- A:- do:bf16 dv:bf16",
        {"BT": CHUNK, "BK": 128, "BV": 128, "USE_G": True, "USE_G_GAMMA": False, "USE_A": False, **VARLEN},
        BWD_CONFIGS),
    "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": FlaKernel(
        "fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
        "q:bf16 k:bf16 w:bf16 g:fp32 gk:- dht:- dh0:- do:bf16 dh:bf16 dv:bf16 dv2:bf16",
        {"BT": CHUNK, "USE_G": True, "USE_GK": False, "USE_INITIAL_STATE": False,
         "USE_FINAL_STATE_GRADIENT": False, "STATE_V_FIRST": False, **VARLEN}, WALK_CONFIGS),
    "chunk_bwd_kernel_dqkwg": FlaKernel(
        "fla.ops.common.chunk_o", "chunk_bwd_kernel_dqkwg",
        "q:bf16 k:bf16 v:bf16 g:fp32 g_gamma:- h:bf16 do:bf16 dh:bf16 dq:bf16 dk:bf16 dw:bf16 dv:bf16 dg:fp32",
        {"B": 1, "BT": CHUNK, "BK": 128, "BV": 128, "USE_G": True, "USE_G_GAMMA": False, "USE_DW": True,
         "STATE_V_FIRST": False, **VARLEN}, BWD_CONFIGS),
    "prepare_wy_repr_bwd_kernel": FlaKernel(
        "fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd_kernel",
        "k:bf16 v:bf16 beta:bf16 g:fp32 A:bf16 dw:bf16 du:bf16 dk:bf16 dv:bf16 db:bf16 dg:fp32",
        {"BT": CHUNK, "BK": 64, "BV": 64, "USE_G": True, **VARLEN}, BWD_CONFIGS),
    "chunk_local_cumsum_scalar_kernel[reverse]": FlaKernel(
        "fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel", "s:fp32 o:fp32 scale:-",
        {"B": 1, "H": 32, "BT": CHUNK, "REVERSE": True, "HAS_SCALE": False, "HEAD_FIRST": False, **VARLEN},
        CUMSUM_CONFIGS),
    "l2norm_bwd_kernel": FlaKernel("fla.modules.l2norm", "l2norm_bwd_kernel", "y:bf16 rstd:fp32 dy:bf16 dx:bf16",
                                   {"D": 128, "BD": 128, "NB": 8}, L2_CONFIGS),
}
"""fla-core 0.5.1's kernels of one ``chunk_gated_delta_rule`` forward and
backward (the launch order is :func:`fla_launches.fla_launches`'), with the block
sizes its host code picks on an H200 and its autotune lists there. ``NB``
(l2norm's row blocks: ceil(rows / 65536)) is 8 at the full shape; it is an
autotune key only (the kernel body does not read it), so one compile serves
every shape. The gate cumsum's ``H`` is the value heads (its gate's heads)."""

TOKEN_PARALLEL_CONFIGS = configs(BH=[1, 2, 4, 8], num_warps=[1, 2, 4, 8], num_stages=[3])
VECTOR_CUMSUM_CONFIGS = configs(BS=[32, 64], num_warps=[2, 4, 8], num_stages=[3])  # BS_LIST: check_shared_mem()
GLA_O_CONFIGS = configs(BK=[32, 64], BV=[64, 128], num_warps=[2, 4, 8], num_stages=[2, 3, 4])
WY_DQKG_CONFIGS = [c for c in configs(BK=[32, 64], BV=[64, 128], num_warps=[2, 4], num_stages=[2, 3, 4])
                   if not (c["BK"] == 32 and c["num_warps"] == 4)]  # Hopper drops BK = 32 at 4 warps
INTRA_BWD_CONFIGS = configs(num_warps=[1, 2, 4, 8], num_stages=[2, 3, 4])
KDA_VARLEN_WALK = {"H": 32, "BT": CHUNK, "USE_G": False, "USE_GK": True, "USE_INITIAL_STATE": False,
                   "STATE_V_FIRST": False, **VARLEN}  # the walks get kg / qg: HV heads, so H = HV

FLA_KDA_KERNELS = {
    "l2norm_fwd_kernel": FLA_KERNELS["l2norm_fwd_kernel"],
    "chunk_local_cumsum_vector_kernel": FlaKernel(
        "fla.ops.utils.cumsum", "chunk_local_cumsum_vector_kernel", "s:bf16 o:fp32",
        {"B": 1, "H": 32, "S": 128, "BT": CHUNK, "REVERSE": False, "HAS_SCALE": True, "HEAD_FIRST": False,
         **VARLEN}, VECTOR_CUMSUM_CONFIGS),
    "chunk_kda_fwd_kernel_intra_token_parallel": FlaKernel(
        "fla.ops.kda.chunk_intra_token_parallel", "chunk_kda_fwd_kernel_intra_token_parallel",
        "q:bf16 k:bf16 g:fp32 beta:bf16 Aqk:bf16 Akk:fp32", {"BT": CHUNK, "BC": 16, **VARLEN},
        TOKEN_PARALLEL_CONFIGS),
    "chunk_kda_fwd_kernel_inter_solve_fused": FlaKernel(
        "fla.ops.kda.chunk_intra", "chunk_kda_fwd_kernel_inter_solve_fused",
        "q:bf16 k:bf16 g:fp32 beta:bf16 Aqk:bf16 Akkd:fp32 Akk:bf16",
        {"BT": CHUNK, "BC": 16, "NC": 4, "USE_SAFE_GATE": False, **VARLEN}, KKT_CONFIGS),
    "recompute_w_u_fwd_kda_kernel": FlaKernel(
        "fla.ops.kda.wy_fast", "recompute_w_u_fwd_kda_kernel",
        "q:- k:bf16 qg:- kg:bf16 v:bf16 beta:bf16 w:bf16 u:bf16 A:bf16 gk:fp32",
        {"BT": CHUNK, "BK": 64, "BV": 64, "STORE_QG": False, "STORE_KG": True, **VARLEN}, WU_CONFIGS),
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64[gk]": FlaKernel(
        "fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "k:bf16 v:bf16 w:bf16 v_new:bf16 g:- gk:fp32 h:bf16 h0:- ht:-",
        {**KDA_VARLEN_WALK, "STORE_FINAL_STATE": False, "SAVE_NEW_VALUE": True}, WALK_CONFIGS),
    "chunk_gla_fwd_kernel_o": FlaKernel(
        "fla.ops.gla.chunk", "chunk_gla_fwd_kernel_o", "q:bf16 v:bf16 g:fp32 h:bf16 o:bf16 A:bf16",
        {"BT": CHUNK, "STATE_V_FIRST": False, **VARLEN}, GLA_O_CONFIGS),
    "recompute_w_u_fwd_kda_kernel[qg]": FlaKernel(
        "fla.ops.kda.wy_fast", "recompute_w_u_fwd_kda_kernel",
        "q:bf16 k:bf16 qg:bf16 kg:bf16 v:bf16 beta:bf16 w:bf16 u:bf16 A:bf16 gk:fp32",
        {"BT": CHUNK, "BK": 64, "BV": 64, "STORE_QG": True, "STORE_KG": True, **VARLEN}, WU_CONFIGS),
    "chunk_kda_bwd_kernel_dAv": FlaKernel(
        "fla.ops.kda.chunk_bwd", "chunk_kda_bwd_kernel_dAv", "q:bf16 k:bf16 v:bf16 A:bf16 do:bf16 dv:bf16 dA:fp32",
        {"BT": CHUNK, "BK": 128, "BV": 128, **VARLEN}, BWD_CONFIGS),
    "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[gk]": FlaKernel(
        "fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
        "q:bf16 k:bf16 w:bf16 g:- gk:fp32 dht:- dh0:- do:bf16 dh:bf16 dv:bf16 dv2:bf16",
        {**KDA_VARLEN_WALK, "USE_FINAL_STATE_GRADIENT": False}, WALK_CONFIGS),
    "chunk_kda_bwd_kernel_wy_dqkg_fused": FlaKernel(
        "fla.ops.kda.chunk_bwd", "chunk_kda_bwd_kernel_wy_dqkg_fused",
        "q:bf16 k:bf16 v:bf16 v_new:bf16 g:fp32 beta:bf16 A:bf16 h:bf16 do:bf16 dh:bf16 dq:fp32 dk:fp32 dv:bf16 "
        "dv2:bf16 dg:fp32 db:fp32 dA:fp32", {"BT": CHUNK, "STATE_V_FIRST": False, **VARLEN}, WY_DQKG_CONFIGS),
    "chunk_kda_bwd_kernel_intra": FlaKernel(
        "fla.ops.kda.chunk_intra", "chunk_kda_bwd_kernel_intra",
        "q:bf16 k:bf16 g:fp32 beta:bf16 dAqk:fp32 dAkk:fp32 dq:fp32 dq2:fp32 dk:fp32 dk2:fp32 dg:fp32 dg2:fp32 "
        "db:fp32", {"BT": CHUNK, "BC": 16, "BK": 32, "NC": 4, "SAFE_GATE": False, "USE_GATHER": True, **VARLEN},
        INTRA_BWD_CONFIGS),
    "chunk_local_cumsum_vector_kernel[reverse]": FlaKernel(
        "fla.ops.utils.cumsum", "chunk_local_cumsum_vector_kernel", "s:fp32 o:fp32 scale:-",
        {"B": 1, "H": 32, "S": 128, "BT": CHUNK, "REVERSE": True, "HAS_SCALE": False, "HEAD_FIRST": False,
         **VARLEN}, VECTOR_CUMSUM_CONFIGS),
    "l2norm_bwd_kernel[fp32 dy]": FlaKernel("fla.modules.l2norm", "l2norm_bwd_kernel",
                                            "y:bf16 rstd:fp32 dy:fp32 dx:bf16", {"D": 128, "BD": 128, "NB": 8},
                                            L2_CONFIGS),
}
"""fla-core 0.5.1's kernels of one ``chunk_kda`` forward and backward (the
launch order is :func:`fla_launches.fla_kda_launches`'): ``chunk_kda(q, k, v,
g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=...)`` with ``g`` the
activated log gates [B, T, HV, K] in bf16 (``use_gate_in_kernel``,
``safe_gate`` and ``disable_recompute`` False, chunks of 64, no initial or
final state), on an H200 with the lists its autotuners hold there.

What the host code launches there: the gate's chunk-local cumsum is the
vector kernel (a [64, BS] tile per program, fp32 out, scaled by 1/ln 2);
with ``safe_gate`` False the diagonal 16 x 16 blocks of Aqk and Akk come
from the token-parallel kernel (a program per token and ``BH`` value heads;
``chunk_kda_fwd_kernel_intra_sub_chunk`` runs only under ``safe_gate``),
then the fused inter-block + triangular-solve kernel (tf32 products) writes
Aqk and the inverse Akk, and ``recompute_w_u_fwd_kda_kernel`` writes w, u and
kg (the backward's recompute also writes qg: ``[qg]``). The state walks are
GDN's kernels with ``gk`` (no scalar ``g``) and are passed kg / qg, whose
heads are the value heads: they compile with H = HV (``[gk]``). The output
is GLA's ``chunk_gla_fwd_kernel_o`` on the saved Aqk. The backward's dq and
dk come out fp32 at the value heads (a torch sum over each key head's group),
so its l2norm backward reads an fp32 ``dy`` (``[fp32 dy]``). Dispatch: the
TileLang ``wy_dqkg`` backend refuses HV != H and FlashKDA serves inference
only, so every kernel is the Triton one. Hopper's lists: ``NUM_WARPS`` [2, 4]
for the backward's kernels and the walks, ``BK_LIST`` [32, 64] and
``BV_LIST`` [64, 128] (``check_shared_mem``), less BK = 32 at 4 warps for
``wy_dqkg``; dAv's BK = BV = 128 (``check_shared_mem('hopper')``), the
intra backward's BK = 32 (host code)."""

FLA_KDA_SAFE_GATE_KERNELS = {
    "chunk_kda_fwd_kernel_intra_sub_chunk": FlaKernel(
        "fla.ops.kda.chunk_intra", "chunk_kda_fwd_kernel_intra_sub_chunk",
        "q:bf16 k:bf16 g:fp32 beta:bf16 Aqk:bf16 Akk:fp32",
        {"BT": CHUNK, "BC": 16, "BK": 128, "USE_GATHER": True, **VARLEN}, INTRA_BWD_CONFIGS),
    "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]": FlaKernel(
        "fla.ops.kda.chunk_intra", "chunk_kda_fwd_kernel_inter_solve_fused",
        "q:bf16 k:bf16 g:fp32 beta:bf16 Aqk:bf16 Akkd:fp32 Akk:bf16",
        {"BT": CHUNK, "BC": 16, "NC": 4, "USE_SAFE_GATE": True, **VARLEN}, KKT_CONFIGS),
    "chunk_kda_bwd_kernel_intra[safe_gate]": FlaKernel(
        "fla.ops.kda.chunk_intra", "chunk_kda_bwd_kernel_intra",
        "q:bf16 k:bf16 g:fp32 beta:bf16 dAqk:fp32 dAkk:fp32 dq:fp32 dq2:fp32 dk:fp32 dk2:fp32 dg:fp32 dg2:fp32 "
        "db:fp32", {"BT": CHUNK, "BC": 16, "BK": 32, "NC": 4, "SAFE_GATE": True, "USE_GATHER": True, **VARLEN},
        INTRA_BWD_CONFIGS),
}
"""The kernels ``chunk_kda(..., safe_gate=True)`` runs in place of three of
:data:`FLA_KDA_KERNELS` (fla-core 0.5.1, ``fla/ops/kda/chunk_intra.py``): the
diagonal 16 x 16 blocks of Aqk and Akk as two ``[16, K] x [K, 16]`` products
per sub-chunk about its middle row (``chunk_kda_fwd_kernel_intra_sub_chunk``,
which also runs the diagonal blocks' substitution), the fused inter-block
kernel without the substitution, and the intra backward's diagonal blocks as
products (``SAFE_GATE``). The safe gate's exponents ``±(g_i - g_mid)`` are
bounded only because its gate is (``lower_bound`` in [-5, 0)); its
autotune lists are Hopper's, as :data:`FLA_KDA_KERNELS`'. Their facts are
``h200_facts.json``'s ``fla_kda_safe_gate``."""

INDEX_POINTERS = ("cu_seqlens", "chunk_indices", "chunk_offsets")
HEADS = {"H": 16, "HV": 32, "K": 128, "V": 128}


def config_key(config: dict) -> str:
    """A configuration as a stable string: ``BK=64,num_warps=4,num_stages=3``."""
    return ",".join(f"{k}={config[k]}" for k in sorted(config))


def import_fla(site: str | None):
    """Import fla-core's kernel modules with the H200's device flags: put
    ``site`` on sys.path, register the package folders without running their
    ``__init__`` files (``fla.ops.kda`` and ``fla.ops.gla`` too: theirs import
    every op of the family; ``fla.ops.utils`` and ``fla.ops.cp`` keep theirs,
    whose names the kernel modules import), and set ``fla.utils``' flags
    (Hopper, tf32, ``check_shared_mem`` true) before any kernel module reads
    them."""
    if site:
        sys.path.insert(0, site)
    registered = sys.modules.get("fla")
    if registered is not None and getattr(registered, "__spec__", None) is None:  # registered here before
        root = Path(registered.__path__[0])
    else:
        spec = importlib.util.find_spec("fla")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("fla (fla-core) is not importable: pass --fla-site DIR of a "
                                      "`pip install --target DIR fla-core==0.5.1`")
        root = Path(next(iter(spec.submodule_search_locations)))
    version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (root / "__init__.py").read_text())
    for package in ("fla", "fla.ops", "fla.modules", "fla.ops.gated_delta_rule", "fla.ops.kda", "fla.ops.gla"):
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(root.joinpath(*package.split(".")[1:]))]
            module.__version__ = version.group(1) if version else "unknown"  # fla.utils reads fla.__version__
            sys.modules[package] = module
    import warnings

    warnings.filterwarnings("ignore", module="fla")  # "Triton is not supported on current platform"
    utils = importlib.import_module("fla.utils")
    for flag in ("IS_NVIDIA", "IS_NVIDIA_HOPPER", "IS_TF32_SUPPORTED"):
        setattr(utils, flag, True)
    utils.check_shared_mem = lambda *args, **kwargs: True
    return utils


def fla_version(site: str | None) -> str:
    """The fla-core version of ``site`` (from its dist-info), or ``unknown``."""
    from importlib import metadata

    try:
        if site:
            for dist in metadata.distributions(path=[site]):
                if dist.metadata["Name"] in ("fla-core", "fla_core"):
                    return dist.version
        return metadata.version("fla-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def compile_config(spec: FlaKernel, config: dict):
    """``spec``'s kernel compiled for sm_90 at one configuration of its list
    (:func:`import_fla` first): the headline's heads (:data:`HEADS`), its
    constexprs, every pointer 16-byte aligned (as ``compile_specs`` compiles
    ours)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(spec.module), spec.function)
    while not isinstance(kernel, JITFunction):  # heuristics / autotuner wrappers
        kernel = kernel.fn
    pointers = dict(item.split(":") for item in spec.pointers.split())
    params = {p.name for p in kernel.params}
    constexprs = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    constants = {k: v for k, v in {**HEADS, **spec.constexprs, **constexprs}.items() if k in params}
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr or pointers.get(p.name) == "-":
            signature[p.name] = "constexpr"
            constants.setdefault(p.name, None)
        elif p.name in pointers or p.name in INDEX_POINTERS:
            signature[p.name] = "*" + pointers.get(p.name, "i64")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "fp32" if p.name in ("eps", "scale") else "i32"
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})


def compile_facts(site: str | None, labels: list[str] | None = None, progress=print,
                  table: dict[str, FlaKernel] = FLA_KERNELS) -> dict[str, dict[str, dict]]:
    """``{kernel: {config_key: facts}}`` for every kernel of ``table`` (default
    :data:`FLA_KERNELS`; :data:`FLA_KDA_KERNELS` for KDA's), or its ``labels``,
    at every configuration of its list, compiled for sm_90:
    registers, spill stores and loads (B/thread), shared memory, warps,
    stages and the products' instruction class. Needs a fresh TRITON_CACHE_DIR
    (a cached kernel skips ptxas and logs nothing)."""
    import triton
    from gdn_kcp.kernels.triton.compile_specs import instruction_class, ptxas_facts

    import_fla(site)
    triton.knobs.nvidia.dump_ptxas_log = True
    out: dict[str, dict[str, dict]] = {}
    for label in labels or list(table):
        spec = table[label]
        out[label] = {}
        start = time.perf_counter()
        for config in spec.configs:
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                compiled = compile_config(spec, config)
            has_dot = "tt.dot" in compiled.asm["ttir"]
            out[label][config_key(config)] = dict(
                config=config, shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                num_stages=compiled.metadata.num_stages, products=instruction_class(compiled.asm["ptx"], has_dot),
                **ptxas_facts(log.getvalue()))
        progress(f"  {label}: {len(spec.configs)} configurations, {time.perf_counter() - start:.0f} s")
    return out
