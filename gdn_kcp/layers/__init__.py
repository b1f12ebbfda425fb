"""Layers over the GDN ops: :class:`GatedDeltaNet` (flash-linear-attention's
constructor, parameter names and shapes) and its decode :class:`Cache`."""

from .cache import Cache
from .gated_deltanet import GatedDeltaNet
from .halo import conv_halo, halo_comm_bytes
from .short_conv import ShortConvolution, short_conv

__all__ = ["Cache", "GatedDeltaNet", "ShortConvolution", "conv_halo", "halo_comm_bytes", "short_conv"]
