"""Parse a `podman run` command line into (flags, image, args), for comparing run lines."""

from __future__ import annotations

from collections import Counter

# podman run flags that take no value (among those the run lines here use).
BOOLEAN_FLAGS = frozenset({"-d", "--detach", "--rm", "--replace", "--privileged", "-t", "-i"})
ALIASES = {"-p": "--publish", "-v": "--volume", "--detach": "-d"}


def parse(argv: list[str]) -> tuple[Counter, str, list[str]]:
    """argv after `podman run` -> (Counter of (flag, value)), image, container args)."""
    flags: Counter = Counter()
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        token = argv[i]
        if "=" in token and token.startswith("--"):
            name, value = token.split("=", 1)
            i += 1
        elif token in BOOLEAN_FLAGS:
            name, value = token, ""
            i += 1
        else:
            name, value = token, argv[i + 1]
            i += 2
        flags[(ALIASES.get(name, name), value)] += 1
    if i >= len(argv):
        raise ValueError(f"no image in {argv}")
    return flags, argv[i], argv[i + 1 :]
