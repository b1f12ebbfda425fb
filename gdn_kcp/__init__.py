"""gdn_kcp: Gated DeltaNet training kernels with key-context parallelism.

See README.md for the quick start, docs/api.md for the public names and
docs/design.md for how it computes.
"""

from gdn_kcp.checkpointing import checkpoint_policy, last_checkpoint_record
from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.context import KcpContext, build_kcp_context
from gdn_kcp.exchange import record_comm_bytes
from gdn_kcp.kcp import gdn_kcp
from gdn_kcp.kda import chunk_kda, fused_recurrent_kda, kda_gate, kda_kcp
from gdn_kcp.options import OptionsKcp
from gdn_kcp.ops import trace_host_path
from gdn_kcp.parallel import check_cp_gradients
from gdn_kcp.queries import (
    gdn_checkpoint_bytes_kcp,
    gdn_comm_bytes_kcp,
    gdn_det_comm_bytes_kcp,
    gdn_det_saved_bytes_kcp,
    gdn_det_saved_layout_kcp,
    gdn_det_workspace_bytes_kcp,
    gdn_det_workspace_layout_kcp,
    gdn_intermediate_states_layout_kcp,
    gdn_saved_bytes_kcp,
    gdn_saved_layout_kcp,
    gdn_state_layout_kcp,
    gdn_workspace_bytes_kcp,
    gdn_workspace_layout_kcp,
    kda_checkpoint_bytes_kcp,
    kda_comm_bytes_kcp,
    kda_det_comm_bytes_kcp,
    kda_det_saved_bytes_kcp,
    kda_det_saved_layout_kcp,
    kda_det_workspace_bytes_kcp,
    kda_det_workspace_layout_kcp,
    kda_intermediate_states_layout_kcp,
    kda_saved_bytes_kcp,
    kda_saved_layout_kcp,
    kda_state_layout_kcp,
    kda_workspace_bytes_kcp,
    kda_workspace_layout_kcp,
)
from gdn_kcp.recurrent import fused_recurrent_gated_delta_rule
from gdn_kcp.reference import naive_kda_recurrence, naive_recurrence
from gdn_kcp.workspace import WorkspaceKcp, record_workspace

from gdn_kcp import layers  # noqa: E402  (gdn_kcp.layers after `import gdn_kcp`; it imports the API above)

__version__ = "0.1.0"

__all__ = [
    "KcpContext",
    "OptionsKcp",
    "WorkspaceKcp",
    "build_kcp_context",
    "check_cp_gradients",
    "checkpoint_policy",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "gdn_checkpoint_bytes_kcp",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
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
    "kda_gate",
    "kda_kcp",
    "kda_checkpoint_bytes_kcp",
    "kda_comm_bytes_kcp",
    "kda_det_comm_bytes_kcp",
    "kda_det_saved_bytes_kcp",
    "kda_det_saved_layout_kcp",
    "kda_det_workspace_bytes_kcp",
    "kda_det_workspace_layout_kcp",
    "kda_intermediate_states_layout_kcp",
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
