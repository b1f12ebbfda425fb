"""torch.library ops of gdn_kcp (``gdn_kcp::fwd``, ``gdn_kcp::bwd``) and the
autograd layer the public functions call."""

from . import library
from .autograd import GdnFunction, apply_gdn, apply_gdn_states, check_workspace, trace_host_path

from gdn_kcp import fake as _fake  # noqa: E402,F401  (registers the fake kernels)

__all__ = ["GdnFunction", "apply_gdn", "apply_gdn_states", "check_workspace", "library", "trace_host_path"]
