"""Which Python files are libraries (torch's, the standard library's) and so never where a
user's line is: capture reports positions and inlines calls by this.
"""
from __future__ import annotations

import os

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def is_library_file(filename: str) -> bool:
    """torch's or the standard library's own Python (not where a user's line is)."""
    return is_torch_file(filename) or (filename.startswith(_STDLIB_DIR)
                                       and "site-packages" not in filename)


def is_torch_file(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR)
