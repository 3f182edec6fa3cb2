"""Triton kernels with vLLM's signatures, each the twin of a ``golden/`` module of the same stem.

On a machine without CUDA the kernels run under Triton's interpreter: importing this package sets
``TRITON_INTERPRET=1`` there (unless the variable is already set) before any kernel is decorated.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
