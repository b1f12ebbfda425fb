"""Decode caches: flash-linear-attention's per-layer cache protocol, and the
short convolution over a cached history.

A model passes one cache object to every layer as ``past_key_values``; layer
``layer_idx`` reads ``cache[layer_idx]`` (a dict) when ``len(cache) >
layer_idx`` and stores its states with ``cache.update(recurrent_state=...,
conv_state=..., layer_idx=..., offset=T)``. FLA's ``fla.models.utils.Cache``
speaks it; :class:`Cache` here is the same protocol without transformers.
:class:`~gdn_kcp.layers.GatedDeltaNet` stores

- ``recurrent_state``: ``[N, HV, K, V]`` (fp32; fp64 for fp64 inputs), the
  GDN state after the last token of each row (document);
- ``conv_state``: ``(q, k, v)``, each ``[N, D_i, W]`` in the projections'
  dtype: the last W inputs of every channel, the newest in column W - 1, zeros
  before a document's first token (FLA's convolution cache).
"""

from __future__ import annotations

from typing import Any

import torch

from .short_conv import short_conv


class Cache:
    """Per-layer recurrent and convolution states for decoding, with FLA's
    ``Cache`` interface (``cache[i]``, ``len``, ``update``, ``get_seq_length``).

    Example::

        cache = Cache()
        o, _, cache = layer(prompt, use_cache=True, past_key_values=cache)   # prefill
        o, _, cache = layer(next_token, use_cache=True, past_key_values=cache)  # one step
    """

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []
        self._seen_tokens = 0

    def __getitem__(self, layer_idx: int) -> dict[str, Any]:
        if not 0 <= layer_idx < len(self.states):
            raise KeyError(f"the cache holds {len(self.states)} layers, asked for layer_idx = {layer_idx}")
        return self.states[layer_idx]

    def __len__(self) -> int:
        return len(self.states)

    def update(self, recurrent_state: Any = None, attn_state: Any = None, conv_state: Any = None,
               ffn_state: Any = None, layer_idx: int = 0, offset: int | None = 1,
               cache_kwargs: dict | None = None) -> dict[str, Any]:
        """Store layer ``layer_idx``'s states (those not None) and count
        ``offset`` tokens seen once per forward, as FLA's cache does: when
        layer 0 is added (the first forward), then at the last layer's update.
        Layers are added in order, as a model's forward visits them."""
        if attn_state is not None:
            raise ValueError("attn_state (an attention layer's keys and values) is not kept by gdn_kcp's Cache: "
                             "for a hybrid model pass flash-linear-attention's Cache, which this layer also speaks")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx <= len(self.states):
            raise ValueError(f"layer_idx must be an int in [0, {len(self.states)}] (layers are added in order), "
                             f"got {layer_idx!r}")
        added = layer_idx == len(self.states)
        if added:
            self.states.append(dict(recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None))
        state = self.states[layer_idx]
        for name, value in (("recurrent_state", recurrent_state), ("conv_state", conv_state),
                            ("ffn_state", ffn_state)):
            if value is not None:
                state[name] = value
        counts = layer_idx == 0 if added else layer_idx == len(self.states) - 1
        if counts:
            self._seen_tokens += 1 if offset is None else offset
        return state

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens seen (0 before layer ``layer_idx`` has stored a state)."""
        return self._seen_tokens if len(self.states) > (layer_idx or 0) else 0


def conv_over_history(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None,
                      bounds: list[int], history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The short convolution of the packed rows ``x`` ``[BT, D]`` (documents at
    ``bounds``), each document continuing from its ``history`` ``[N, D, W]``
    (zeros when None), and the documents' new histories ``[N, D, W]``.

    Each document runs with its history's last ``W - 1`` inputs in front (a
    longer document of the same op; their outputs are dropped), so the
    convolution's forward and backward are :func:`short_conv`'s. The new
    history is the last W inputs of history + document."""
    N, D, W = len(bounds) - 1, x.shape[1], weights[0].shape[-1]
    if history is None:
        history = x.new_zeros(N, D, W)
    rows = history.transpose(1, 2).reshape(N * W, D).to(x.dtype)  # document n's history: rows n W .. n W + W - 1
    source = torch.cat([rows, x])
    taken, outputs, starts, last = [], [], [], []
    for n, (bos, eos) in enumerate(zip(bounds, bounds[1:])):
        own = list(range(N * W + bos, N * W + eos))
        starts.append(len(taken))
        taken += list(range(n * W + 1, n * W + W)) + own
        outputs += range(len(taken) - len(own), len(taken))
        last += (list(range(n * W, n * W + W)) + own)[-W:]
    index = torch.tensor(taken, dtype=torch.int64, device=x.device)
    y = short_conv(source[index][None], weights, biases, torch.tensor(starts, device=x.device))[0]
    new = source[torch.tensor(last, dtype=torch.int64, device=x.device)].view(N, W, D).transpose(1, 2)
    return y[torch.tensor(outputs, dtype=torch.int64, device=x.device)], new.contiguous()
