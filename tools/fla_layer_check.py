"""flash-linear-attention's own ``GatedDeltaNet`` and ``KimiDeltaAttention``
layers against ours, on the CPU.

FLA's layers (flash-linear-attention 0.5.1 over fla-core 0.5.1) run their Triton
kernels under triton 3.6's interpreter; ours loads FLA's state dict with
``strict=True`` and runs in fp64. Compared, each as ``max |ours - FLA| /
max |FLA|``: training forwards (batch rows, packed ``cu_seqlens``), the
gradients of every parameter, left-padded ``attention_mask`` rows, and eval
generation through one cache protocol (a prefill, then one-token steps; FLA's
layers take their ``fused_recurrent`` paths there, ours the recurrent step).

Usage (``make fla-layer-check`` downloads the site)::

    python tools/fla_layer_check.py --site DIR   # DIR holds fla, einops and triton 3.6.0

FLA's kernels were written for a GPU; three interpreter shortcomings are patched
here at run time (nothing of FLA's is changed): a one-element loop bound as a
``range`` argument, loop counters as Triton scalars (``i_t.to(tl.int64)``),
and autotuning (the interpreter cannot time; the first configuration runs).
KDA's ``safe_gate`` kernel takes FLA's own path for Tritons without
``tl.gather`` (see :func:`import_fla_layers`).

FLA computes in fp32 here, ours in fp64; every figure must stay within
``TOLERANCE`` (fp32's class: the measured worst is printed, about 1e-6).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import types

TOLERANCE = 1e-4
CONFIGS = {
    # name: (layer, FLA's constructor keywords): GVA, conv bias, no-gate, no-conv, negative eigenvalues;
    # KDA's lower-bound gate with safe_gate (FLA's bounded-gate kernels) and without A_log's softplus
    "gva_conv_bias": ("GatedDeltaNet", dict(hidden_size=48, head_dim=16, num_heads=2, num_v_heads=4,
                                            expand_v=1.5, conv_bias=True)),
    "no_conv_neg_eig": ("GatedDeltaNet", dict(hidden_size=32, head_dim=16, num_heads=2, expand_v=1,
                                              use_short_conv=False, allow_neg_eigval=True)),
    "no_gate_conv3": ("GatedDeltaNet", dict(hidden_size=32, head_dim=16, num_heads=1, num_v_heads=2, expand_v=1,
                                            use_gate=False, conv_size=3)),
    "kda_gva_conv_bias": ("KimiDeltaAttention", dict(hidden_size=48, head_dim=16, num_heads=2, num_v_heads=4,
                                                     expand_v=1.5, conv_bias=True)),
    "kda_no_conv_neg_eig_lower_bound": ("KimiDeltaAttention", dict(
        hidden_size=32, head_dim=16, num_heads=2, expand_v=1, use_short_conv=False, allow_neg_eigval=True,
        safe_gate=True, lower_bound=-5.0)),
    "kda_conv3_lower_bound": ("KimiDeltaAttention", dict(hidden_size=32, head_dim=32, num_heads=1, num_v_heads=2,
                                                         expand_v=0.5, conv_size=3, lower_bound=-2.0)),
}
T, PREFILL, STEPS = 40, 9, 5


def patch_interpreter() -> None:
    """Make triton 3.6's interpreter run FLA's kernels as a GPU would."""
    from triton.runtime import autotuner, interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        # a scalar loaded from memory is a one-element array here; range() needs an int
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor

    def visit_for(self, node):
        # compiled Triton makes a loop counter a tensor; FLA's kernels call .to() on it
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            wrap = ast.parse(f"{node.target.id} = {node.target.id}").body[0]
            node.body.insert(0, self.visit_Assign(wrap))
        return node

    interpreter.ASTTransformer.visit_For = visit_for
    init = autotuner.Autotuner.__init__

    def first_config(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config


def import_fla_layers() -> dict:
    """FLA's layer modules alone: ``fla.layers``' package init imports every layer, some of
    which need transformers; these two do not."""
    import fla

    package = types.ModuleType("fla.layers")
    package.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
    sys.modules["fla.layers"] = package
    from fla.layers.gated_deltanet import GatedDeltaNet
    from fla.layers.kda import KimiDeltaAttention
    from fla.ops.kda import chunk_intra

    # safe_gate's sub-chunk kernel reads a row of the gate with tl.gather through FLA's module-level alias,
    # which the interpreter cannot call (it patches tl's functions when a kernel runs, after the alias was
    # taken); FLA's own fallback for Tritons without gather loads the same row from memory instead
    chunk_intra.IS_GATHER_SUPPORTED = False
    return {"GatedDeltaNet": GatedDeltaNet, "KimiDeltaAttention": KimiDeltaAttention}


def relative(ours, fla) -> float:
    ours, fla = ours.detach().double(), fla.detach().double()
    return float((ours - fla).abs().max() / fla.abs().max())


def pair(FlaLayer, name: str, config: dict, seed: int):
    import torch

    from gdn_kcp import layers

    torch.manual_seed(seed)
    fla = FlaLayer(layer_idx=0, **config)
    with torch.no_grad():  # FLA zero-initialises nothing we compare on, but make every term count
        for p in fla.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ours = getattr(layers, name)(layer_idx=0, **config).double()
    ours.load_state_dict({k: v.double() for k, v in fla.state_dict().items()}, strict=True)
    return fla, ours


def check_training(fla, ours, x, rows: dict, **kwargs) -> None:
    import torch

    fla.train(), ours.train()
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    o_fla = fla(x, **kwargs)[0]
    o_ours = ours(x.double(), **kwargs)[0]
    rows["forward"] = relative(o_ours, o_fla)
    (o_fla * weight).sum().backward()
    (o_ours * weight.double()).sum().backward()
    named = dict(fla.named_parameters())
    rows["gradients (worst parameter)"] = max(relative(p.grad, named[n].grad) for n, p in ours.named_parameters())
    fla.zero_grad(), ours.zero_grad()


def check_mask(fla, ours, x, rows: dict) -> None:
    import torch

    fla.eval(), ours.eval()
    mask = torch.ones(x.shape[:2], dtype=torch.long)
    mask[0, :7] = 0  # left padding of row 0
    with torch.no_grad():
        o_fla = fla(x, attention_mask=mask)[0]
        o_ours = ours(x.double(), attention_mask=mask)[0]
    keep = mask.bool()
    rows["attention_mask (kept tokens)"] = relative(o_ours[keep], o_fla[keep])


def check_generation(fla, ours, x, rows: dict) -> None:
    import torch

    from gdn_kcp.layers import Cache

    fla.eval(), ours.eval()
    cache_fla, cache_ours = Cache(), Cache()  # FLA's layer reads and updates any object of its protocol
    worst_prefill, worst_step = 0.0, 0.0
    with torch.no_grad():
        o_fla = fla(x[:, :PREFILL], past_key_values=cache_fla, use_cache=True)[0]
        o_ours = ours(x[:, :PREFILL].double(), past_key_values=cache_ours, use_cache=True)[0]
        worst_prefill = relative(o_ours, o_fla)
        for t in range(PREFILL, PREFILL + STEPS):
            o_fla = fla(x[:, t:t + 1], past_key_values=cache_fla, use_cache=True)[0]
            o_ours = ours(x[:, t:t + 1].double(), past_key_values=cache_ours, use_cache=True)[0]
            worst_step = max(worst_step, relative(o_ours, o_fla))
    rows["generation: prefill"] = worst_prefill
    rows[f"generation: {STEPS} decode steps (worst)"] = worst_step
    # FLA keeps the recurrent states V-first; our GDN layer K-first (same numbers, transposed), our KDA layer
    # V-first as FLA's KDA layer
    state_fla = cache_fla[0]["recurrent_state"]
    if not ours.STATE_V_FIRST:
        state_fla = state_fla.transpose(-1, -2)
    rows["generation: final recurrent state"] = relative(cache_ours[0]["recurrent_state"], state_fla)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", required=True, help="folder with fla (layers + core), einops and triton 3.6.0")
    args = parser.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, args.site)
    import torch
    import triton

    if triton.__version__ != "3.6.0":
        raise SystemExit(f"--site must hold triton 3.6.0 (FLA 0.5.1's kernels), found {triton.__version__}")
    patch_interpreter()
    fla_layers = import_fla_layers()
    failures = 0
    for seed, (name, (layer, config)) in enumerate(CONFIGS.items()):
        fla, ours = pair(fla_layers[layer], layer, config, seed)
        x = torch.randn(2, T, config["hidden_size"], generator=torch.Generator().manual_seed(seed + 100))
        rows: dict[str, float] = {}
        check_training(fla, ours, x, rows)
        packed = {}
        check_training(fla, ours, x[:1], packed, cu_seqlens=torch.tensor([0, 13, 13 + 1, T]))
        rows.update({f"cu_seqlens {k}": v for k, v in packed.items()})
        check_mask(fla, ours, x, rows)
        check_generation(fla, ours, x, rows)
        print(f"{name}: {layer} {config}")
        for what, error in rows.items():
            ok = error <= TOLERANCE
            failures += not ok
            print(f"  {what:<42} {error:9.2e}  {'ok' if ok else 'FAIL'}")
    print(f"{'all within' if not failures else f'{failures} above'} {TOLERANCE:g} of FLA's layers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
