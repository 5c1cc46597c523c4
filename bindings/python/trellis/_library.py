"""Finding the operator library (libtrellis_ops.so) and loading it into the running PyTorch.

An installed package carries the library beside this file, with ``_build_info.py`` saying which PyTorch it was built
against. A build tree is used by pointing ``TRELLIS_OPS_LIBRARY`` at its ``libtrellis_ops.so`` (and, to get the same
version check, ``TRELLIS_TORCH_VERSION`` at the release it was built with), with ``bindings/python/`` on ``PYTHONPATH``.
"""
import os
from pathlib import Path
from typing import Optional

import torch

OPS_LIBRARY_ENV = "TRELLIS_OPS_LIBRARY"
TORCH_VERSION_ENV = "TRELLIS_TORCH_VERSION"


def release(version: str) -> str:
    """The release of a PyTorch version string: ``"2.11.0+cu130"`` -> ``"2.11.0"``."""
    return version.split("+", 1)[0]


def check_torch_version(expected: str, found: str = torch.__version__) -> None:
    """Raise ImportError unless the running PyTorch is the release the library was built against."""
    if release(found) != expected:
        raise ImportError(
            f"trellis was built against PyTorch {expected} and cannot run with the PyTorch {found} imported from "
            f"{Path(torch.__file__).parent}: its operators are C++ compiled against LibTorch's ABI, which changes "
            f"between releases. Install torch=={expected} (Trellis supports exactly that release), or use an "
            f"environment that has it.")


def locate() -> "tuple[Path, Optional[str], Optional[str]]":
    """The operator library's path, the PyTorch release it needs (None: unchecked) and Trellis' version."""
    override = os.environ.get(OPS_LIBRARY_ENV)
    if override:
        return Path(override), os.environ.get(TORCH_VERSION_ENV) or None, None
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(
            f"trellis is not built here ({Path(__file__).parent} has no _build_info.py): install the package with "
            f"`pip install .` from the Trellis source tree, or set {OPS_LIBRARY_ENV} to the libtrellis_ops.so of a "
            f"CMake build") from None
    return Path(__file__).with_name("libtrellis_ops.so"), _build_info.TORCH_VERSION, _build_info.VERSION


def load() -> Optional[str]:
    """Load the operators into ``torch.ops.trellis``; returns Trellis' version (None for a build tree)."""
    path, torch_version, version = locate()
    if torch_version is not None:
        check_torch_version(torch_version)
    if not path.is_file():
        raise ImportError(f"trellis: the operator library {path} does not exist")
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        raise ImportError(f"trellis: cannot load the operator library {path} into PyTorch {torch.__version__}: {e}") \
            from e
    return version
