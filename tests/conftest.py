"""Test set-up: 8 CPU devices (for sharding tests) and the shared data directory.

XLA_FLAGS must be set before JAX is imported anywhere, so this runs first.
"""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "LOWRANK_ATTN_DATA",
    str(pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"),
)
