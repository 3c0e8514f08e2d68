"""Old import path of flashnext.plan.partition, kept for code outside the launcher that
imports it by this name (checks/patches, checks/qsa, checks/contract): the same module."""

import sys

from flashnext.plan import partition

sys.modules[__name__] = partition
