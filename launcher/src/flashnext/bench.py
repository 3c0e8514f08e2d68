"""Old import path of flashnext.tools.bench, kept for code outside the launcher that
imports it by this name (checks/checkpoint): the same module."""

import sys

from flashnext.tools import bench

sys.modules[__name__] = bench
