"""Forward + backward time of a transformers Qwen-family model on gdn_kcp's ops
(``use_gdn_kcp``, light and full save modes) against the same model on
transformers' own torch fallbacks, measured in the same run, on the CPU.

    python benchmarks/transformers_cpu.py [--tokens 2048] [--repeats 3] [--family qwen3_5]
                                          [--layers linear,linear,linear,full]

The model is a small random one with Qwen3.5's linear-attention head shape
(2 key heads, 4 value heads, K = V = 128, the shape of the ops-alone figures
in docs/api.md), hidden size 256, a dense MLP (no experts: their eager loop
would be most of the time and the same on both sides) and by default
Qwen3.5's three linear-attention layers to one softmax-attention layer. One
row of ``--tokens`` tokens, fp32, ``labels=input_ids``, ``use_cache=False``:
transformers' fallback refuses packed bounds, so both sides run one document.
The rounds interleave the three variants and each figure is the best of its
``--repeats`` calls (after one warm-up call each), so a busy moment of a
shared machine slows one call, not one variant. The ratio printed is the
variant's time over transformers' fallback's (above 1: slower). The losses
are printed beside the times: both sides compute the same model.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from gdn_kcp.integrations.transformers import use_gdn_kcp

LAYER_NAMES = {"linear": "linear_attention", "full": "full_attention"}
MODELS = {  # family: (config class, model class)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


def build(family: str, layer_types: list[str]) -> torch.nn.Module:
    config_name, model_name = MODELS[family]
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    dense = dict(num_experts=0) if family == "qwen3_next" else {}
    config = getattr(configs, config_name)(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=layer_types, pad_token_id=0, **dense)
    torch.manual_seed(0)
    return getattr(modeling, model_name)(config)


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """One forward and backward: ``(seconds, loss)``."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return time.perf_counter() - start, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", choices=sorted(MODELS), default="qwen3_5")
    parser.add_argument("--layers", default="linear,linear,linear,full",
                        help="comma-separated layer kinds, each 'linear' or 'full'")
    args = parser.parse_args()
    kinds = args.layers.split(",")
    unknown = [kind for kind in kinds if kind not in LAYER_NAMES]
    if unknown:
        parser.error(f"--layers: {unknown} are not 'linear' or 'full'")
    model = build(args.family, [LAYER_NAMES[kind] for kind in kinds])
    ids = torch.randint(1, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    variants = {
        "transformers' fallback": lambda: step(model, ids),
        "gdn_kcp, light": lambda: run_patched(model, ids, "light"),
        "gdn_kcp, full": lambda: run_patched(model, ids, "full"),
    }
    print(f"{args.family}, layers {args.layers}, T = {args.tokens}, linear attention HV = 4, K = V = 128, fp32, "
          f"{torch.get_num_threads()} thread(s)")
    best = {name: float("inf") for name in variants}
    losses = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, run in variants.items():
            seconds, losses[name] = run()
            if round_:
                best[name] = min(best[name], seconds)
    baseline = best["transformers' fallback"]
    for name, seconds in best.items():
        print(f"{name:24s} {seconds * 1e3:9.1f} ms  {seconds / baseline:5.2f}x  (loss {losses[name]:.6f})")


def run_patched(model: torch.nn.Module, ids: torch.Tensor, save_mode: str) -> tuple[float, float]:
    with use_gdn_kcp(families=[model.config.model_type.removesuffix("_text")], save_mode=save_mode):
        return step(model, ids)


if __name__ == "__main__":
    main()
