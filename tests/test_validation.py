"""Every input check of chunk_gated_delta_rule (and of build_kcp_context's
cu_seqlens_global) raises with the argument and value named."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs

from gdn_kcp import build_kcp_context, chunk_gated_delta_rule


def inputs(T=8, H_qk=1, HV=2, K=4, V=4):
    return make_inputs(T, H_qk, HV, K, V)


def call(q, k, v, g, beta, **kw):
    return chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def test_q_not_a_tensor():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor .* got list"):
        call(q.tolist(), k, v, g, beta)


@pytest.mark.parametrize("name,index", [("q", 0), ("k", 1), ("v", 2)])
def test_wrong_rank_qkv(name, index):
    args = inputs()
    args[index] = args[index][0]
    with pytest.raises(ValueError, match=rf"{name} must be a 4-D tensor .* got shape \("):
        call(*args)


@pytest.mark.parametrize("name,index", [("g", 3), ("beta", 4)])
def test_wrong_rank_gates(name, index):
    args = inputs()
    args[index] = args[index][..., None]
    with pytest.raises(ValueError, match=rf"{name} must be a 3-D tensor"):
        call(*args)


def test_k_shape_mismatch():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"k must have q's shape \(1, 8, 1, 4\), got \(1, 8, 1, 5\)"):
        call(q, torch.zeros(1, 8, 1, 5, dtype=q.dtype), v, g, beta)


def test_v_length_mismatch():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"v must be \[B, T, HV, V\] with B, T = 1, 8 .* got \(1, 7, 2, 4\)"):
        call(q, k, v[:, :7], g, beta)


@pytest.mark.parametrize("name,index", [("g", 3), ("beta", 4)])
def test_gate_shape_mismatch(name, index):
    args = inputs()
    args[index] = args[index][..., :1]
    with pytest.raises(ValueError, match=rf"{name} must have shape \[B, T, HV\] = \(1, 8, 2\), got \(1, 8, 1\)"):
        call(*args)


def test_heads_not_divisible():
    q, k, v, g, beta = inputs(H_qk=2, HV=3)
    with pytest.raises(ValueError, match=r"HV = 3 .* must be a multiple of H_qk = 2"):
        call(q, k, v, g, beta)


def test_unsupported_dtype():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"q has dtype torch.int64"):
        call(q.long(), k, v, g, beta)


def test_dtype_mismatch():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"v has dtype torch.float32, q has torch.float64"):
        call(q, k, v.float(), g, beta)


def test_cu_seqlens_not_1d():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor .* got shape \(1, 3\)"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([[0, 4, 8]]))


def test_cu_seqlens_float():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got torch.float32"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 8.0]))


def test_cu_seqlens_on_meta():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"cu_seqlens is on device meta, which holds no values"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 8], device="meta"))


def test_cu_seqlens_global_on_meta():
    with pytest.raises(ValueError, match=r"cu_seqlens_global is on device meta, which holds no values"):
        build_kcp_context(torch.tensor([0, 3, 8], device="meta"))


def test_cu_seqlens_not_starting_at_zero():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, got \[1, 8\]"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([1, 8]))


def test_cu_seqlens_decreasing():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"non-decreasing, got cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 3, 8]))


def test_cu_seqlens_not_ending_at_t():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"cu_seqlens must end at T = 8, got cu_seqlens\[-1\] = 7"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 7]))


def test_batch_with_cu_seqlens():
    q, k, v, g, beta = make_inputs(8, 1, 2, 4, 4, B=2)
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch must be 1 \(packed\), got B = 2"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))


def test_initial_state_wrong_shape():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\] = \(2, 2, 4, 4\), got \(1, 2, 4, 4\)"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 2, 4, 4))


def test_initial_state_wrong_dtype():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"initial_state has dtype torch.int32"):
        call(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 4, dtype=torch.int32))


def test_scale_not_a_number():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"scale must be a float or None, got str '0.5'"):
        call(q, k, v, g, beta, scale="0.5")


def test_scale_not_finite():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match=r"scale must be finite, got nan"):
        call(q, k, v, g, beta, scale=float("nan"))


def test_flag_not_bool():
    q, k, v, g, beta = inputs()
    with pytest.raises(TypeError, match=r"output_final_state must be a bool, got int 1"):
        call(q, k, v, g, beta, output_final_state=1)


def test_empty_documents_are_legal():
    q, k, v, g, beta = inputs()
    o, fs = call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 0, 8, 8]), output_final_state=True)
    assert o.shape == (1, 8, 2, 4)
    assert fs.shape == (3, 2, 4, 4)
    assert fs[0].abs().max() == 0 and fs[2].abs().max() == 0 and fs[1].abs().max() > 0


def test_cuda_head_dims_beyond_the_checked_sizes_are_refused():
    """The CUDA programs take K <= 256 and V <= 512, the sizes their compile
    check, twins and arena test run at; beyond, a ValueError names both."""
    from gdn_kcp.ops.autograd import check_triton_head_dims

    check_triton_head_dims(256, 512)
    with pytest.raises(ValueError, match=r"take K <= 256 and V <= 512 .*got K = 512, V = 128"):
        check_triton_head_dims(512, 128)
    with pytest.raises(ValueError, match=r"got K = 128, V = 1024"):
        check_triton_head_dims(128, 1024)
