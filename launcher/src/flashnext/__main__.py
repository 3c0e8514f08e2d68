"""`python -m flashnext` runs the CLI (the repo's ./flashnext bootstrap uses it)."""

import os

# ./flashnext lifts PYTHONDONTWRITEBYTECODE so the launcher's own bytecode is cached
# (in its venv); vLLM and anything else the launcher runs get the user's value back.
_kept = os.environ.pop("FLASHNEXT_KEPT_PYTHONDONTWRITEBYTECODE", None)
if _kept is not None:
    os.environ["PYTHONDONTWRITEBYTECODE"] = _kept

from flashnext.cli import main  # noqa: E402
from flashnext.invocation import invoked_as  # noqa: E402

main(prog_name=invoked_as())
