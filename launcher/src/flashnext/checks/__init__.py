"""Pure checks over facts: preflight (preflight.py, the registry of one module per domain:
gpu, host, rank_fit, mtp, model, table, vllm_env, port, over inputs.py's PreflightInput)
and the checkpoint's metadata, each returning the one Finding type (finding.py)."""

from flashnext.checks.finding import LEVELS, Finding, Level, worst

__all__ = ["LEVELS", "Finding", "Level", "worst"]
