"""`python -m flashnext` runs the CLI (the repo's ./flashnext bootstrap uses it)."""

from flashnext.cli import main
from flashnext.invocation import invoked_as

main(prog_name=invoked_as())
