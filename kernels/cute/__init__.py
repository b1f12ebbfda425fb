"""CuTe DSL programs (nvidia-cutlass-dsl, ``pip install -e .[cute]``) for
sm_90a: :func:`scores` and :func:`w_u`, the two simplest chunk-parallel
programs, with the same signatures as ``kernels.torch``; every other program
is the Triton one. ``use_programs("cuda", "cute")`` selects this backend; it
is never the default.

Status: compiled and checked on the CPU (``CUTE_DSL_ARCH=sm_90a``, fake
tensors: tests/test_cute_compile.py), not yet run on a GPU; the GPU check's
``cute`` stage runs them against their torch twins. A call they do not
cover (fp32 / fp64 inputs, K or V other than 64 and 128, a traced call under
torch.compile) runs the Triton program. Importing this module imports the DSL;
nothing else in the package does.
"""

from ..triton import *  # noqa: F403  (every program without a CuTe one)
from ..triton import __all__ as _triton_all
from .w_u import w_u
from .scores import scores

CUTE_PROGRAMS = ("scores", "w_u")
"""The programs this backend runs itself."""

__all__ = list(_triton_all)
