"""transformers' GDN and KDA model families on gdn_kcp's ops
(:mod:`gdn_kcp.integrations.transformers`): tiny random models in fp64 on the
CPU, patched against transformers' own torch fallbacks.

transformers' fallbacks and norms cast to ``torch.float32`` by name; the
reference runs the modeling module with a ``torch`` whose ``float32`` is
float64 (:func:`fp64_modeling`), so both sides compute in fp64 and agree to
fp64 rounding, and the 1e-10 bound checks the ops, not fp32 rounding. The
Kimi family's chunked fallback also rounds its decay mask with ``.float()``,
so its reference is transformers' token-by-token fallback (the same
recurrence)."""

import contextlib
import importlib
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

from gdn_kcp.integrations import transformers as integration  # noqa: E402
from gdn_kcp.integrations.transformers import (  # noqa: E402
    FAMILIES, GDN, KDA, OP_NAMES, check_version, installed_families, is_patched, torch_function, use_gdn_kcp,
)

RTOL = 1e-10

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              layer_types=["linear_attention", "full_attention"], experts_implementation="eager",
              initializer_range=0.2)
GDN_DIMS = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
KDA_DIMS = dict(linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4)

# family: (config class, model class, config keywords). GQA (1 key head, 2 value heads) in every GDN family.
MODELS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**GDN_DIMS, **MOE}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", GDN_DIMS),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**GDN_DIMS, **MOE}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", GDN_DIMS),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", {**GDN_DIMS, **MOE}),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    {**KDA_DIMS, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", KDA_DIMS),
}
PRESENT = installed_families()
MODEL_FAMILIES = [f for f in MODELS if f in PRESENT]


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


def modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def build(family: str, **overrides):
    config_name, model_name, extra = MODELS[family]
    config_module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    config = getattr(config_module, config_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    return getattr(modeling(family), model_name)(config).to(torch.float64)


@contextlib.contextmanager
def fp64_modeling(family: str):
    """The family's modeling module sees a ``torch`` whose ``float32`` is
    float64 (see the module docstring)."""
    module = modeling(family)
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    proxy.float32 = torch.float64
    saved = module.torch
    module.torch = proxy
    try:
        yield module
    finally:
        module.torch = saved


@contextlib.contextmanager
def kda_reference(family: str):
    """The Kimi family's chunked op replaced by transformers' own token-by-token fallback."""
    module = modeling(family)
    chunk_name, recurrent_name = OP_NAMES[KDA]
    recurrent = torch_function(getattr(module, recurrent_name))
    saved = getattr(module, chunk_name)

    def chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, **kwargs):
        return recurrent(query, key, value, g, beta, initial_state, output_final_state, **kwargs)

    setattr(module, chunk_name, chunk)
    try:
        yield
    finally:
        setattr(module, chunk_name, saved)


def reference(family: str):
    stack = contextlib.ExitStack()
    stack.enter_context(fp64_modeling(family))
    if FAMILIES[family] == KDA:
        stack.enter_context(kda_reference(family))
    return stack


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.grad is not None}


def test_the_named_families_are_present():
    """transformers 5.25 ships these; the tests below run on each one present."""
    for family in ("qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear"):
        assert family in PRESENT, sorted(PRESENT)
    assert {PRESENT[f] for f in PRESENT} == {GDN, KDA}


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_training_step_equals_transformers(family):
    """Logits, loss and every parameter's gradient of the patched model equal
    the unpatched model's (transformers' torch fallbacks), fp64, 1e-10."""
    model = build(family)
    ids = torch.randint(3, 64, (2, 100), generator=torch.Generator().manual_seed(1))
    with reference(family):
        logits, loss, grads = train_step(model, ids)
    with fp64_modeling(family), use_gdn_kcp():
        assert is_patched(family)
        ours_logits, ours_loss, ours_grads = train_step(model, ids)
    assert not is_patched(family)
    assert rel(ours_logits, logits) < RTOL
    assert rel(ours_loss, loss) < RTOL
    assert set(ours_grads) == set(grads) and len(grads) > 10
    worst = max(grads, key=lambda n: rel(ours_grads[n], grads[n]))
    assert rel(ours_grads[worst], grads[worst]) < RTOL, worst


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_prefill_then_decode_equals_full_forward(family, monkeypatch):
    """A 20-token prefill, then 4 cached one-token steps (gdn_kcp's
    token-by-token op on transformers' cache states), equal one forward over
    all 24."""
    name = "fused_recurrent_gated_delta_rule" if FAMILIES[family] == GDN else "fused_recurrent_kda"
    steps_taken = []

    def counted(*args, **kwargs):
        steps_taken.append(args[0].shape[1])
        return original(*args, **kwargs)

    original = getattr(integration, name)
    monkeypatch.setattr(integration, name, counted)
    model = build(family).eval()
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), fp64_modeling(family), use_gdn_kcp():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :20], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(20, 24):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    assert steps_taken == [1] * 4
    assert rel(torch.cat(steps, 1), full) < RTOL


def packed_inputs(lengths=(37, 63), seed=3):
    ids = torch.randint(3, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
                   position_ids=position_ids)
    return ids, cu, packing


def matmul_parameters(model) -> list[str]:
    """The weights of every ``nn.Linear`` and ``nn.Conv1d`` (each projection of
    the linear-attention layers, their short convolution, the MLPs, the head):
    fp64 throughout. The norms' and gates' parameters are left out: the
    layers cast them with the tensor method ``.float()`` (which fp64_modeling
    cannot reach), so their gradient is rounded to fp32 once per forward call,
    and one packed call and two apart differ there by fp32 rounding whatever
    the ops compute."""
    return [f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d))]


@pytest.mark.parametrize("family", [f for f in ("qwen3_next", "qwen3_5", "kimi_linear", "bailing_hybrid")
                                    if f in PRESENT])
def test_packed_documents_stay_apart(family):
    """Two documents in one row with their bounds (``cu_seq_lens_q``, as
    DataCollatorWithFlattening passes them) equal the two run apart: logits,
    the gradient of every token's embedding, and the gradient of every weight
    of :func:`matmul_parameters`. Both families: the Qwen layers pass
    the bounds to the op, the Kimi layers leave them in the keywords the
    patched op reads; the short convolution restarts at the second document.
    Every layer is linear: transformers' softmax-attention layers keep packed
    documents apart only to about 2e-8 in fp64 (measured on these models),
    and they are not ours."""
    model = build(family, layer_types=["linear_attention", "linear_attention"])
    ids, cu, packing = packed_inputs()
    embeds = model.get_input_embeddings()(ids).detach()
    with fp64_modeling(family), use_gdn_kcp():
        model.zero_grad(set_to_none=True)
        packed_in = embeds.clone().requires_grad_()
        packed = model(inputs_embeds=packed_in, use_cache=False, **packing).logits
        packed.square().sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        apart_in = embeds.clone().requires_grad_()
        apart = torch.cat([model(inputs_embeds=apart_in[:, a:b], use_cache=False).logits
                           for a, b in zip(cu[:-1], cu[1:])], 1)
        apart.square().sum().backward()
    assert rel(packed, apart) < RTOL
    assert rel(packed_in.grad, apart_in.grad) < RTOL
    compared = [n for n in matmul_parameters(model) if n in packed_grads]
    assert len(compared) > 10 and any("conv1d" in n for n in compared)
    for name in compared:
        assert rel(packed_grads[name], model.get_parameter(name).grad) < RTOL, name


@pytest.mark.parametrize("family", [f for f in ("qwen3_next", "kimi_linear") if f in PRESENT])
def test_unpatched_packed_batch_is_not_kept_apart(family):
    """Why the patch matters: transformers' own fallbacks refuse the Qwen
    layers' bounds and drop the Kimi layers' (documents mixed)."""
    model = build(family)
    ids, cu, packing = packed_inputs()
    with torch.no_grad(), fp64_modeling(family):
        if FAMILIES[family] == GDN:
            with pytest.raises(ValueError, match="packed sequences apart"):
                model(ids, use_cache=False, **packing)
            return
        packed = model(ids, use_cache=False, **packing).logits
        second = model(ids[:, int(cu[1]):], use_cache=False).logits
    assert rel(packed[:, int(cu[1]):], second) > 1e-3


def test_use_gdn_kcp_restores_and_nests():
    family = MODEL_FAMILIES[0]
    module = modeling(family)
    names = (*OP_NAMES[FAMILIES[family]], "causal_conv1d_fn")
    originals = [getattr(module, name) for name in names]
    outer = use_gdn_kcp()
    assert all(is_patched(f) for f in PRESENT)
    with use_gdn_kcp(families=[family]) as inner:
        assert inner.families == (family,) and is_patched(family)
    assert is_patched(family)  # the outer patch still holds
    outer.restore()
    outer.restore()  # a second restore does nothing
    assert [getattr(module, name) for name in names] == originals
    assert not any(is_patched(f) for f in PRESENT)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="families: 'mamba'"):
        use_gdn_kcp(families=["mamba"])
    with pytest.raises(TypeError, match="families must be"):
        use_gdn_kcp(families="qwen3_next")
    with pytest.raises(ValueError, match="save_mode"):
        use_gdn_kcp(save_mode="heavy")
    with pytest.raises(ValueError, match="family must be one of"):
        is_patched("mamba")
    assert not any(is_patched(f) for f in PRESENT)


def test_unsupported_version_raises(monkeypatch):
    check_version("5.25.0")
    for version in ("5.24.0", "5.26.0", "6.0.0"):
        with pytest.raises(RuntimeError, match=f"installed one is {version}"):
            check_version(version)
    monkeypatch.setattr(integration, "transformers_version", lambda: "4.57.1")
    with pytest.raises(RuntimeError, match="transformers >= 5.25, < 5.26"):
        use_gdn_kcp()
    assert not any(is_patched(f) for f in PRESENT)


def test_changed_call_raises(monkeypatch):
    """A family whose op declares other parameters, or has gone, is refused
    before anything is patched."""
    family = MODEL_FAMILIES[0]
    module = modeling(family)
    chunk_name = OP_NAMES[FAMILIES[family]][0]

    def changed(query, key, value, decay, beta, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(module, chunk_name, changed)
    with pytest.raises(RuntimeError, match=f"{family}.{chunk_name} declares parameters"):
        use_gdn_kcp()
    monkeypatch.delattr(module, chunk_name)
    with pytest.raises(RuntimeError, match=f"{family} has no module-level {chunk_name}"):
        use_gdn_kcp()
    monkeypatch.undo()
    assert not any(is_patched(f) for f in PRESENT)


@pytest.mark.parametrize("family", [f for f in ("qwen3_next", "kimi_linear") if f in PRESENT])
def test_unknown_keywords_and_seq_idx_raise(family):
    """A keyword transformers does not pass on, or a batch packed by
    ``seq_idx`` alone, is an error naming the family, never dropped."""
    module = modeling(family)
    chunk_name = OP_NAMES[FAMILIES[family]][0]
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    g = -torch.rand(1, 8, 2, *(() if FAMILIES[family] == GDN else (16,)), dtype=torch.float64)
    beta = torch.rand(1, 8, 2, dtype=torch.float64)
    with use_gdn_kcp(families=[family]):
        op = getattr(module, chunk_name)
        with pytest.raises(TypeError, match=f"{family} called {chunk_name} with keywords \\['window'\\]"):
            op(q, q, q, g, beta, window=4)
        with pytest.raises(ValueError, match=f"{family}: a batch packed by seq_idx"):
            op(q, q, q, g, beta, seq_idx=torch.zeros(1, 8, dtype=torch.int32))
        conv = module.causal_conv1d_fn
        x, w = torch.randn(1, 6, 8, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
        with pytest.raises(ValueError, match=f"{family}: a packed batch needs .* activation is 'gelu'"):
            conv(x, w, None, activation="gelu", cu_seq_lens_q=torch.tensor([0, 3, 8]))
        with pytest.raises(ValueError, match="cu_seq_lens_q ends at 7 but the convolution sees 8"):
            conv(x, w, None, activation="silu", cu_seq_lens_q=torch.tensor([0, 3, 7]))


def test_import_gdn_kcp_does_not_import_transformers():
    code = ("import sys, gdn_kcp, gdn_kcp.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def linear_layer(model):
    """The first decoder layer's linear-attention module (``linear_attn`` in
    the Qwen family, ``self_attn`` in the Kimi family)."""
    decoder = model.model.layers[0]
    return getattr(decoder, "linear_attn", None) or decoder.self_attn


@pytest.mark.parametrize("family", [f for f in ("qwen3_next", "kimi_linear") if f in PRESENT])
def test_patched_layer_has_no_graph_break(family):
    """One patched linear-attention layer under dynamo: one graph, no break,
    with and without packing bounds (the convolution's bounds check is a
    device assert when traced, and a one-rank call builds its context without
    ``max(..., default=)``, which dynamo cannot trace); compiled with
    ``fullgraph=True``, forward and backward equal eager."""
    layer = linear_layer(build(family))
    x = torch.randn(1, 100, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 37, 100], dtype=torch.int32)
    packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=63, max_length_k=63)
    with use_gdn_kcp(families=[family]):
        for keywords in ({}, packing):
            torch._dynamo.reset()
            explained = torch._dynamo.explain(layer)(x, **keywords)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
                [b.reason for b in explained.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        results = []
        for run in (compiled, layer):
            leaf = x.clone().requires_grad_()
            out = run(leaf, **packing)
            out = out[0] if isinstance(out, tuple) else out
            out.square().sum().backward()
            results.append((out.detach(), leaf.grad))
    torch._dynamo.reset()
    (out, grad), (eager_out, eager_grad) = results
    assert rel(out, eager_out) < RTOL and rel(grad, eager_grad) < RTOL


KCP_FAMILIES = [f for f in ("qwen3_next", "kimi_linear") if f in PRESENT]


@pytest.mark.parametrize("R", [2, 3])
def test_kcp_equals_one_rank(R):
    """An all-linear model of a GDN and of a KDA family under
    ``kcp(ctx)`` on R gloo ranks (uneven ranges, a document crossing every
    rank): loss and every gradient summed over the ranks equal one rank's
    run of the packed stream, fp64, 1e-10 (tests/transformers_kcp_cases.py)."""
    from spawn import spawn_ranks
    from transformers_kcp_cases import check_model_on_rank

    for family in KCP_FAMILIES:
        spawn_ranks(R, check_model_on_rank, family)


@pytest.mark.parametrize("family", KCP_FAMILIES)
def test_kcp_refusals(family):
    """What a KCP call cannot take is an error naming it: ``kcp`` with no
    family patched, packing keywords (the context
    holds the packing), rows other than the rank's range, a cache. On one
    rank, ``kcp(ctx)`` gives the packed call's logits."""
    from gdn_kcp import OptionsKcp, build_kcp_context
    from gdn_kcp.integrations.transformers import kcp

    model = build(family, layer_types=["linear_attention", "linear_attention"])
    ids, cu, packing = packed_inputs()
    ctx = build_kcp_context(cu.tolist())
    with pytest.raises(TypeError, match="ctx must be a KcpContext, got list"):
        kcp(cu.tolist())
    with pytest.raises(TypeError, match="options must be an OptionsKcp or None, got str"):
        kcp(ctx, options="full")
    with pytest.raises(RuntimeError, match="no family is patched"):
        with kcp(ctx):
            pass
    with torch.no_grad(), fp64_modeling(family), use_gdn_kcp(families=[family]):
        packed = model(ids, use_cache=False, **packing).logits
        with kcp(ctx, options=OptionsKcp(save_mode="full")):
            assert rel(model(ids, use_cache=False).logits, packed) < RTOL
            with pytest.raises(ValueError, match=f"{family}: under kcp\\(ctx\\) the context holds the packing"):
                model(ids, use_cache=False, **packing)
            with pytest.raises(ValueError, match="rank 0 runs its range \\[0, 100\\) .* got 1 row\\(s\\) of 99"):
                model(ids[:, 1:], use_cache=False)
        hybrid = build(family)  # transformers' cache needs a softmax-attention layer
        with kcp(ctx), pytest.raises(ValueError, match=f"{family}: .* use_cache=False"):
            hybrid(ids, use_cache=True)
