"""Program implementations of gdn_kcp, one file per program and backend.

Installed as ``gdn_kcp.kernels``. Every backend (``torch``, ``triton``; ``cute``
later) exposes the same programs with the same signatures: tensors in,
results written into buffers handed to the program, a :class:`ChunkIndex` of
int32 tensors, and Python ints that are shape facts.

Imported as a top-level ``kernels`` (only possible when the repository root is
on ``sys.path``: a script, ``python -m`` or pytest run from a checkout), this
file hands the import to the ``kernels`` the rest of ``sys.path`` holds: that
name is the PyPI package transformers loads its hub kernels from, and a
checkout must not shadow it (docs/api.md, "transformers' models").
"""

if __name__ == "kernels":
    import importlib as _importlib
    import os as _os
    import sys as _sys

    def _import_shadowed_kernels():
        """Import ``kernels`` from ``sys.path`` without this checkout's root.
        The import system returns what ``sys.modules["kernels"]`` holds once
        this file has run, so the other package replaces this one there."""
        root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

        def is_root(entry):
            try:
                return _os.path.samefile(entry or _os.curdir, root)
            except (OSError, TypeError, ValueError):  # a missing folder, a zip, a non-path entry
                return False

        saved = list(_sys.path)
        _sys.modules.pop("kernels", None)
        _sys.path[:] = [entry for entry in saved if not is_root(entry)]
        try:
            return _importlib.import_module("kernels")
        except ModuleNotFoundError as error:
            if error.name != "kernels":
                raise
            raise ModuleNotFoundError(
                f"No module named 'kernels' (the folder {root}/kernels is gdn_kcp's programs, importable as "
                "gdn_kcp.kernels; the top-level name belongs to the PyPI package `kernels`, not installed here)",
                name="kernels") from None
        finally:
            _sys.path[:] = saved

    _import_shadowed_kernels()
else:
    from .chunk_index import CHUNK_SIZE, CROSSING_IN, CROSSING_OUT, ChunkIndex

    __all__ = ["CHUNK_SIZE", "CROSSING_IN", "CROSSING_OUT", "ChunkIndex"]
