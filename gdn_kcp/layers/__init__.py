"""Layers over the ops: :class:`GatedDeltaNet` and :class:`KimiDeltaAttention`
(flash-linear-attention's constructors, parameter names and shapes, on the
shared :class:`~gdn_kcp.layers.delta_layer.DeltaRuleLayer`) and their decode
:class:`Cache`."""

from .cache import Cache
from .gated_deltanet import GatedDeltaNet
from .halo import conv_halo, halo_comm_bytes
from .kimi_delta_attention import KimiDeltaAttention
from .short_conv import ShortConvolution, short_conv

__all__ = ["Cache", "GatedDeltaNet", "KimiDeltaAttention", "ShortConvolution", "conv_halo", "halo_comm_bytes",
           "short_conv"]
