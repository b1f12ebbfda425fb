"""Byte queries: pure functions of (context, shapes, dtypes, options). The host
path and the exchanges size every pool, saved tensor and message by calling them."""

from .comm import COLLECTIVES, a2a_split_elements, gdn_comm_bytes_kcp, gdn_det_comm_bytes_kcp, ring_elements
from .layout import (
    CallLayout,
    CheckpointBytes,
    PoolSpec,
    SavedSpec,
    WorkspaceLayout,
    gdn_checkpoint_bytes_kcp,
    gdn_det_saved_bytes_kcp,
    gdn_det_saved_layout_kcp,
    gdn_det_workspace_bytes_kcp,
    gdn_det_workspace_layout_kcp,
    gdn_saved_bytes_kcp,
    gdn_saved_layout_kcp,
    gdn_state_layout_kcp,
    gdn_workspace_bytes_kcp,
    gdn_workspace_layout_kcp,
)

__all__ = [
    "COLLECTIVES",
    "CallLayout",
    "CheckpointBytes",
    "PoolSpec",
    "SavedSpec",
    "WorkspaceLayout",
    "a2a_split_elements",
    "gdn_checkpoint_bytes_kcp",
    "gdn_comm_bytes_kcp",
    "gdn_det_comm_bytes_kcp",
    "gdn_det_saved_bytes_kcp",
    "gdn_det_saved_layout_kcp",
    "gdn_det_workspace_bytes_kcp",
    "gdn_det_workspace_layout_kcp",
    "gdn_saved_bytes_kcp",
    "gdn_saved_layout_kcp",
    "gdn_state_layout_kcp",
    "gdn_workspace_bytes_kcp",
    "gdn_workspace_layout_kcp",
    "ring_elements",
]
