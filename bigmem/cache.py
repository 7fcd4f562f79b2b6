"""Where bigmem keeps what it measured or made for this user: ``$BIGMEM_CACHE_DIR``, else ``~/.cache/bigmem``.

The memory calibrations (memory/calibration.py), the kernel tuning (nets/tuning.py) and the
synthetic stores (data/synth.py) live there; each is keyed by what it is valid for.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$BIGMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/bigmem``, else ``~/.cache/bigmem`` (not created here)."""
    root = os.environ.get("BIGMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "bigmem")
    return Path(root)
