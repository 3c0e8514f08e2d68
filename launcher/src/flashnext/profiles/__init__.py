"""Hardware profiles: one TOML per machine shape; 3x3090 is the default.

A profile says what hardware it is for (matched against HostFacts) and the
serving settings that were measured to work on it. Loading validates every
field so a typo in a TOML is an error here, not a surprise in vLLM.

Sections [table], [vllm] and [checkpoint] and the key `auto_select` are
optional: a profile without them gets the defaults below.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

from flashnext.facts.schema import GpuDevice, HostFacts


class ProfileError(ValueError):
    """A profile that does not exist, does not parse, or does not fit the host."""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    """Substring of NVML's device name, case-insensitive."""
    count: int
    memory_bytes: int
    """Nominal memory of one card, used when the facts have no GPUs to read it from."""
    min_memory_bytes: int
    min_compute_capability: str
    bandwidth_bytes_per_s: int
    """Peak memory bandwidth of one card, for the decode roofline."""
    min_pcie_gen: int
    min_pcie_width: int

    def matches(self, device: GpuDevice) -> bool:
        return self.name.lower() in device.name.lower()


@dataclass(frozen=True)
class ParallelSpec:
    pipeline_parallel_size: int
    tensor_parallel_size: int


@dataclass(frozen=True)
class SchedulerSpec:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool


@dataclass(frozen=True)
class MemorySpec:
    gpu_memory_utilization: float
    workspace_margin_bytes: int
    """Per card, on top of the weights: kernel workspace, PLE prefetch buffers."""
    pp_buffer_bytes: int
    """Send/receive buffers of one PP hop; middle ranks hold two."""
    activation_reserve_bytes: int
    """Activations of one prefill chunk and captured graphs, per card."""
    kv_cache_memory_bytes_max: int
    """Upper bound on --kv-cache-memory-bytes."""
    host_overhead_bytes: int
    """Host RAM for processes, page tables and staging, beyond the pinned pools."""
    min_shm_bytes: int


@dataclass(frozen=True)
class CompilationSpec:
    mode: int
    cudagraph_mode: str
    cudagraph_capture_sizes: tuple[int, ...]


@dataclass(frozen=True)
class QsaOffloadSpec:
    enabled: bool
    max_host_bytes: int
    """Cap on the pinned host K/V arenas of one rank."""
    host_pinning: str
    """"exact" (cudaHostRegister) or "pow2" (PyTorch's pinned allocator rounds up)."""
    chunk_tokens: int
    """Tokens per chunk a prefill streams through its VRAM work buffer."""


TABLE_MEDIUM_CHECKS = ("fail", "warn")


@dataclass(frozen=True)
class TableSpec:
    medium_check: str = "fail"
    """What preflight makes of a table on a medium `table prepare` refuses (rotational,
    network, RAM, overlay): "fail" (default), or "warn" for a table small enough to
    live in the page cache."""


@dataclass(frozen=True)
class VllmSpec:
    additional_config: dict[str, Any] = field(default_factory=dict)
    """vLLM's --additional-config (one JSON object); empty: the flag is not passed."""


@dataclass(frozen=True)
class CheckpointSpec:
    hub_repo: str | None = None
    """The Hugging Face repository of the checkpoint the profile serves, for the
    download command preflight suggests; None: not published."""
    skeleton: str | None = None
    """The `flashnext skeleton` variant with its exact tensor inventory: without a
    readable --model, preflight sizes host RAM and memlock from it. None: no such
    inventory (host memory then needs --model)."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    default: bool
    gpu: GpuSpec
    parallel: ParallelSpec
    scheduler: SchedulerSpec
    memory: MemorySpec
    compilation: CompilationSpec
    qsa_offload: QsaOffloadSpec
    env: dict[str, str]
    table: TableSpec = field(default_factory=TableSpec)
    vllm: VllmSpec = field(default_factory=VllmSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    auto_select: bool = True
    """Whether a host with this profile's GPUs gets it without --profile. Test
    profiles set it false: they are chosen by name only."""

    def matches(self, facts: HostFacts) -> bool:
        """The host has exactly the profile's GPUs (count and model)."""
        devices = facts.gpu.devices
        return len(devices) == self.gpu.count and all(self.gpu.matches(d) for d in devices)


def _section(cls: type, doc: dict[str, Any], where: str, optional: bool = False) -> Any:
    """One [table] of the TOML as `cls`: every field present (unless `optional`: the
    dataclass defaults fill in), nothing unknown."""
    names = {f.name for f in fields(cls)}
    missing = set() if optional else names - set(doc)
    problems = [
        f"{label} {', '.join(sorted(keys))}"
        for label, keys in (("missing", missing), ("unknown", set(doc) - names))
        if keys
    ]
    if problems:
        raise ProfileError(f"{where}: {'; '.join(problems)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})


def parse_profile(text: str, source: str) -> Profile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{source}: not valid TOML ({exc})") from exc
    sections = {
        "gpu": GpuSpec,
        "parallel": ParallelSpec,
        "scheduler": SchedulerSpec,
        "memory": MemorySpec,
        "compilation": CompilationSpec,
        "qsa_offload": QsaOffloadSpec,
    }
    try:
        built = {k: _section(cls, doc[k], f"{source} [{k}]") for k, cls in sections.items()}
    except KeyError as exc:
        raise ProfileError(f"{source}: missing section [{exc.args[0]}]") from exc
    optional = {"table": TableSpec, "vllm": VllmSpec, "checkpoint": CheckpointSpec}
    for key, cls in optional.items():
        if key in doc:
            if not isinstance(doc[key], dict):
                raise ProfileError(f"{source}: [{key}] must be a table")
            built[key] = _section(cls, doc[key], f"{source} [{key}]", optional=True)
    profile = Profile(
        name=doc["name"],
        description=doc.get("description", ""),
        default=bool(doc.get("default", False)),
        auto_select=doc.get("auto_select", True),
        env={str(k): str(v) for k, v in doc.get("env", {}).items()},
        **built,
    )
    if profile.qsa_offload.host_pinning not in ("exact", "pow2"):
        raise ProfileError(f"{source}: qsa_offload.host_pinning must be 'exact' or 'pow2'")
    if profile.table.medium_check not in TABLE_MEDIUM_CHECKS:
        raise ProfileError(f"{source}: table.medium_check must be 'fail' or 'warn'")
    if not isinstance(profile.vllm.additional_config, dict):
        raise ProfileError(f"{source}: vllm.additional_config must be a table")
    if not isinstance(profile.auto_select, bool):
        raise ProfileError(f"{source}: auto_select must be true or false")
    if profile.checkpoint.skeleton not in (None, "full", "tiny"):
        raise ProfileError(f"{source}: checkpoint.skeleton must be 'full' or 'tiny'")
    return profile


def available_profiles() -> dict[str, Profile]:
    """Every profile shipped with the launcher, by name."""
    found: dict[str, Profile] = {}
    for entry in resources.files(__name__).iterdir():
        if entry.name.endswith(".toml"):
            profile = parse_profile(entry.read_text(), entry.name)
            found[profile.name] = profile
    return found


def check_profile_name(name: str | None, profiles: dict[str, Profile] | None = None) -> str | None:
    """`name` when a profile of that name is shipped (or None); ProfileError otherwise."""
    profiles = available_profiles() if profiles is None else profiles
    if name is not None and name not in profiles:
        raise ProfileError(f"unknown profile {name!r}; available: {', '.join(sorted(profiles))}")
    return name


def select_profile(facts: HostFacts, requested: str | None) -> tuple[Profile, str]:
    """The profile to plan for, and why it was chosen.

    An explicit name wins (an unknown name is an error). Otherwise the first
    profile whose GPUs match the host, among those that may be picked
    automatically (`auto_select`; test profiles are chosen by name only); with
    no match (or no GPUs, as when planning on a laptop) the default profile,
    saying so.
    """
    profiles = available_profiles()
    if requested is not None:
        check_profile_name(requested, profiles)
        return profiles[requested], "chosen with --profile"
    for profile in sorted(profiles.values(), key=lambda p: p.name):
        if profile.auto_select and profile.matches(facts):
            return profile, "matches the GPUs in the facts"
    default = next(p for p in profiles.values() if p.default)
    seen = len(facts.gpu.devices)
    return default, f"default profile (no profile matches the {seen} GPU(s) in the facts)"
