"""Old import path of flashnext.plan.qsa_sizing, kept for code outside the launcher that
imports it by this name (checks/patches, checks/qsa, checks/contract): the same module."""

import sys

from flashnext.plan import qsa_sizing

sys.modules[__name__] = qsa_sizing
