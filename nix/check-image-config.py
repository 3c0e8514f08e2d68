#!/usr/bin/env python3
"""Compare an image's config with the contract documented in containers/README.md.

    check-image-config.py --readme containers/README.md --inspect INSPECT.json [--kind K]
    check-image-config.py --readme containers/README.md --config CONFIG.json [--kind K]

INSPECT.json is what `podman image inspect IMAGE` prints (a list of one image:
its "Config" and, podman's place for it, a top-level "Healthcheck"; Docker's
inspect keeps it as Config.Healthcheck, also read). CONFIG.json is the config
object of a Docker image config (Entrypoint, Env, ExposedPorts, Healthcheck),
as nix/image.nix passes it to dockerTools, for where no image can be built
(the Nix sandbox check). Durations there are nanoseconds.

--kind nix (default): the environment must be exactly `nix_image_env`.
--kind debian (containers/Containerfile): exactly `debian_image_env`.
--kind containerfile (containers/vllm-openai.Containerfile): the environment
must hold `env` (the base image's own variables come with it).

The contract is the JSON block between the README's
`<!-- image-contract:begin -->` and `<!-- image-contract:end -->` markers.
Exit 0 when they agree, 1 with one line per difference. Standard library only:
it runs in the Nix sandbox (checks.image-config) and in checks/nix and
checks/containers.
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
DURATION_RE = re.compile(r"(\d+)(ns|us|ms|s|m|h)")
NS = {"ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
# Kinds whose whole environment the contract fixes, and the contract key that does.
EXACT_ENV = {"nix": "nix_image_env", "debian": "debian_image_env"}
IMAGE_SOURCE = {
    "nix": "nix/image.nix",
    "debian": "containers/Containerfile",
    "containerfile": "containers/vllm-openai.Containerfile",
}
HEALTH_KEYS = (("interval", "Interval"), ("timeout", "Timeout"), ("start_period", "StartPeriod"))


class ContractError(ValueError):
    """The README has no readable contract, or the input is not an image config."""


def read_contract(readme: Path) -> dict:
    match = BLOCK_RE.search(readme.read_text())
    if not match:
        raise ContractError(
            f"{readme}: no ```json block between <!-- image-contract:begin --> and "
            "<!-- image-contract:end -->; restore the 'Image contract' section"
        )
    try:
        contract = json.loads(match.group("json"))
    except json.JSONDecodeError as exc:
        raise ContractError(f"{readme}: image contract is not JSON ({exc})") from exc
    missing = {
        "entrypoint", "exposed_ports", "healthcheck", "env", "nix_image_env", "debian_image_env"
    } - set(contract)  # fmt: skip
    if missing:
        raise ContractError(f"{readme}: image contract lacks {sorted(missing)}")
    return contract


def duration_ns(text: str) -> int:
    """A Go-style duration ("30s", "35m", "1h30m") in nanoseconds."""
    parts = DURATION_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ContractError(f"{text!r} is not a duration like 30s or 35m")
    return sum(int(n) * NS[u] for n, u in parts)


def from_inspect(doc) -> dict:
    """The config object (with its healthcheck) of `podman/docker image inspect` output."""
    images = doc if isinstance(doc, list) else [doc]
    if len(images) != 1 or not isinstance(images[0], dict) or "Config" not in images[0]:
        raise ContractError("expected the output of `podman image inspect IMAGE` for one image")
    image = images[0]
    config = dict(image["Config"] or {})
    # An OCI config has no healthcheck: podman reports a Docker image's beside it
    # (spelt Healthcheck by podman 4, HealthCheck in its Go type), Docker inside it.
    health = image.get("Healthcheck") or image.get("HealthCheck") or config.get("Healthcheck")
    config["Healthcheck"] = health
    return config


def entrypoint_differences(contract: dict, config: dict) -> list[str]:
    """The first element may be a store path ending in /bin/<name>; the rest must match."""
    want = contract["entrypoint"]
    got = config.get("Entrypoint") or []
    program_ok = bool(got) and (got[0] == want[0] or got[0].endswith(f"/bin/{want[0]}"))
    if program_ok and got[1:] == want[1:]:
        return []
    return [f"Entrypoint is {got}, the contract says {want} (program may be a /bin/ path)"]


def env_of(config: dict) -> dict[str, str]:
    got: dict[str, str] = {}
    for entry in config.get("Env") or []:
        name, _, value = entry.partition("=")
        got[name] = value
    return got


def env_differences(contract: dict, config: dict, kind: str) -> list[str]:
    got = env_of(config)
    exact = EXACT_ENV.get(kind)
    want: dict[str, str] = contract[exact] if exact else contract["env"]
    names = sorted(set(want) | set(got)) if exact else sorted(want)
    return [
        f"Env {name}: image has {got.get(name)!r}, the contract says {want.get(name)!r}"
        for name in names
        if want.get(name) != got.get(name)
    ]


def port_differences(contract: dict, config: dict) -> list[str]:
    want = sorted(contract["exposed_ports"])
    got = sorted(config.get("ExposedPorts") or {})
    return [] if want == got else [f"ExposedPorts is {got}, the contract says {want}"]


def healthcheck_differences(contract: dict, config: dict) -> list[str]:
    want = contract["healthcheck"]
    got = config.get("Healthcheck")
    if not got or not got.get("Test"):
        return [
            f"Healthcheck: the image has none, the contract says {want['test']} every "
            f"{want['interval']} (an OCI-format image cannot carry one: build with "
            "--format docker)"
        ]
    out = []
    if got["Test"] != want["test"]:
        out.append(f"Healthcheck test is {got['Test']}, the contract says {want['test']}")
    for key, field in HEALTH_KEYS:
        if got.get(field) != duration_ns(want[key]):
            out.append(f"Healthcheck {field} is {got.get(field)} ns, the contract says {want[key]}")
    if got.get("Retries") != want["retries"]:
        out.append(
            f"Healthcheck Retries is {got.get('Retries')}, the contract says {want['retries']}"
        )
    return out


def contract_differences(contract: dict) -> list[str]:
    """The contract's own consistency: each image sets what every image sets."""
    return [
        f"contract: {key} {name} is {contract[key].get(name)!r}, env says {value!r}"
        for key in sorted(EXACT_ENV.values())
        for name, value in sorted(contract["env"].items())
        if contract[key].get(name) != value
    ]


def differences(contract: dict, config: dict, kind: str = "nix") -> list[str]:
    return (
        contract_differences(contract)
        + entrypoint_differences(contract, config)
        + env_differences(contract, config, kind)
        + port_differences(contract, config)
        + healthcheck_differences(contract, config)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--inspect", type=Path, help="`podman image inspect IMAGE` output")
    source.add_argument("--config", type=Path, help="a Docker image config's config object")
    parser.add_argument("--kind", choices=("nix", "debian", "containerfile"), default="nix")
    args = parser.parse_args(argv)
    try:
        contract = read_contract(args.readme)
        if args.inspect:
            config = from_inspect(json.loads(args.inspect.read_text()))
        else:
            config = json.loads(args.config.read_text())
        problems = differences(contract, config, args.kind)
    except (OSError, ContractError, json.JSONDecodeError) as exc:
        print(f"check-image-config: {exc}", file=sys.stderr)
        return 1
    for line in problems:
        print(f"check-image-config: {line}", file=sys.stderr)
    if problems:
        image = IMAGE_SOURCE[args.kind]
        print(
            f"check-image-config: fix {image} or the 'Image contract' section of "
            f"{args.readme}, whichever is wrong",
            file=sys.stderr,
        )
        return 1
    print(f"check-image-config: image config matches {args.readme} ({args.kind} image)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
