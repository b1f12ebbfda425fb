"""Pins the public surface: adding or removing a name is a deliberate change."""

import gdn_kcp


def test_all_is_pinned():
    assert sorted(gdn_kcp.__all__) == [
        "KcpContext",
        "OptionsKcp",
        "WorkspaceKcp",
        "build_kcp_context",
        "check_cp_gradients",
        "checkpoint_policy",
        "chunk_gated_delta_rule",
        "chunk_kda",
        "fused_recurrent_gated_delta_rule",
        "fused_recurrent_kda",
        "gdn_checkpoint_bytes_kcp",
        "gdn_comm_bytes_kcp",
        "gdn_det_comm_bytes_kcp",
        "gdn_det_saved_bytes_kcp",
        "gdn_det_saved_layout_kcp",
        "gdn_det_workspace_bytes_kcp",
        "gdn_det_workspace_layout_kcp",
        "gdn_intermediate_states_layout_kcp",
        "gdn_kcp",
        "gdn_saved_bytes_kcp",
        "gdn_saved_layout_kcp",
        "gdn_state_layout_kcp",
        "gdn_workspace_bytes_kcp",
        "gdn_workspace_layout_kcp",
        "kda_checkpoint_bytes_kcp",
        "kda_comm_bytes_kcp",
        "kda_det_comm_bytes_kcp",
        "kda_det_saved_bytes_kcp",
        "kda_det_saved_layout_kcp",
        "kda_det_workspace_bytes_kcp",
        "kda_det_workspace_layout_kcp",
        "kda_gate",
        "kda_intermediate_states_layout_kcp",
        "kda_kcp",
        "kda_saved_bytes_kcp",
        "kda_saved_layout_kcp",
        "kda_state_layout_kcp",
        "kda_workspace_bytes_kcp",
        "kda_workspace_layout_kcp",
        "last_checkpoint_record",
        "layers",
        "naive_kda_recurrence",
        "naive_recurrence",
        "record_comm_bytes",
        "record_workspace",
        "trace_host_path",
    ]


def test_every_name_resolves():
    for name in gdn_kcp.__all__:
        assert getattr(gdn_kcp, name) is not None, name
