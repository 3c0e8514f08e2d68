"""Pure checks over facts: preflight (preflight.py) and the checkpoint's metadata, each
returning the one Finding type (finding.py)."""

from flashnext.checks.finding import LEVELS, Finding, Level, worst
from flashnext.checks.preflight import PreflightInput, _table_size, preflight, vllm_env

# _table_size: checks/table tests its layout arithmetic through this name.
__all__ = ["LEVELS", "Finding", "Level", "PreflightInput", "_table_size", "preflight",
           "vllm_env", "worst"]  # fmt: skip
