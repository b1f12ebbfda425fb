"""Layers over the GDN ops: :class:`GatedDeltaNet` (flash-linear-attention's
constructor, parameter names and shapes)."""

from .gated_deltanet import GatedDeltaNet
from .short_conv import ShortConvolution, short_conv

__all__ = ["GatedDeltaNet", "ShortConvolution", "short_conv"]
