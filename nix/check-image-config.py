#!/usr/bin/env python3
"""Compare an OCI image config with the contract documented in containers/README.md.

    check-image-config.py --readme containers/README.md --config CONFIG.json

CONFIG.json is the image's config object (Entrypoint, Env, ExposedPorts), as
nix/image.nix passes it to dockerTools or as `podman inspect` shows it under
"Config". The contract is the JSON block between the README's
`<!-- image-contract:begin -->` and `<!-- image-contract:end -->` markers.
Exit 0 when they agree, 1 with one line per difference. Standard library only:
it runs in the Nix sandbox (checks.image-config) and in checks/nix.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BLOCK_RE = re.compile(
    r"<!-- image-contract:begin -->\s*```json\n(?P<json>.*?)```\s*<!-- image-contract:end -->",
    re.S,
)


class ContractError(ValueError):
    """The README has no readable contract block."""


def read_contract(readme: Path) -> dict:
    match = BLOCK_RE.search(readme.read_text())
    if not match:
        raise ContractError(
            f"{readme}: no ```json block between <!-- image-contract:begin --> and "
            "<!-- image-contract:end -->; restore the 'Image contract' section"
        )
    try:
        return json.loads(match.group("json"))
    except json.JSONDecodeError as exc:
        raise ContractError(f"{readme}: image contract is not JSON ({exc})") from exc


def entrypoint_differences(contract: dict, config: dict) -> list[str]:
    """The first element may be a store path ending in /bin/<name>; the rest must match."""
    want = contract["entrypoint"]
    got = config.get("Entrypoint") or []
    program_ok = bool(got) and (got[0] == want[0] or got[0].endswith(f"/bin/{want[0]}"))
    if program_ok and got[1:] == want[1:]:
        return []
    return [f"Entrypoint is {got}, the contract says {want} (program may be a /bin/ path)"]


def env_differences(contract: dict, config: dict) -> list[str]:
    want: dict[str, str] = contract["nix_image_env"]
    got: dict[str, str] = {}
    for entry in config.get("Env") or []:
        name, _, value = entry.partition("=")
        got[name] = value
    out = []
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            out.append(
                f"Env {name}: image has {got.get(name)!r}, the contract says {want.get(name)!r}"
            )
    return out


def port_differences(contract: dict, config: dict) -> list[str]:
    want = sorted(contract["exposed_ports"])
    got = sorted(config.get("ExposedPorts") or {})
    return [] if want == got else [f"ExposedPorts is {got}, the contract says {want}"]


def differences(contract: dict, config: dict) -> list[str]:
    return (
        entrypoint_differences(contract, config)
        + env_differences(contract, config)
        + port_differences(contract, config)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        contract = read_contract(args.readme)
        config = json.loads(args.config.read_text())
    except (OSError, ContractError, json.JSONDecodeError) as exc:
        print(f"check-image-config: {exc}", file=sys.stderr)
        return 1
    problems = differences(contract, config)
    for line in problems:
        print(f"check-image-config: {line}", file=sys.stderr)
    if problems:
        print(
            "check-image-config: fix nix/image.nix or the 'Image contract' section of "
            f"{args.readme}, whichever is wrong",
            file=sys.stderr,
        )
        return 1
    print(f"check-image-config: image config matches {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
