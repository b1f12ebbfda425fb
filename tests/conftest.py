import os
import sys
from pathlib import Path

# CI has no GPU: the Triton programs run on the CPU under Triton's interpreter.
# Set before anything imports triton; a GPU run sets TRITON_INTERPRET=0 itself.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

sys.path.insert(0, str(Path(__file__).parent))
