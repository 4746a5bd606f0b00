"""Fixtures of the launcher tests (helpers in launch_support.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_support import real_taskd, vendors  # noqa: E402,F401  (session fixtures)
