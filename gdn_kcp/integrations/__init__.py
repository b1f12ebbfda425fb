"""Other libraries' models on gdn_kcp's ops.

Each submodule imports its library when it is called, never at
``import gdn_kcp`` (the library is an optional extra):
:mod:`gdn_kcp.integrations.transformers` for Hugging Face transformers' Gated
DeltaNet and KDA model families.
"""
