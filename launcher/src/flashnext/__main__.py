"""`python -m flashnext` runs the CLI (the repo's ./flashnext bootstrap uses it)."""

from flashnext.cli import main

main()
