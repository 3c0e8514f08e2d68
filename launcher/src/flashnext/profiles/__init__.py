"""Hardware profiles: one TOML per machine shape; 3x3090 is the default.

A profile says what hardware it is for (matched against HostFacts) and the
serving settings that were measured to work on it. Loading validates every
field so a typo in a TOML is an error here, not a surprise in vLLM.

Sections [table], [vllm], [checkpoint] and [mtp] and the key `auto_select` are
optional: a profile without them gets the defaults below.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import field
from importlib import resources
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic.dataclasses import dataclass

from flashnext.facts.schema import GpuDevice, HostFacts


class ProfileError(ValueError):
    """A profile that does not exist, does not parse, or does not fit the host."""


# A key the dataclass does not declare is a typo: refused, named.
_FORBID_UNKNOWN = ConfigDict(extra="forbid")
# Bounds, declared with the fields they bind (pydantic checks them when a TOML loads).
Bytes = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(ge=1)]


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class OtherCard:
    """A card the profile's settings hold on as they are, with its own figures."""

    name: StrictStr
    """Substring of NVML's device name, case-insensitive."""
    memory_bytes: Positive
    """Nominal memory of one card, as GpuSpec.memory_bytes (the card's own NVML total)."""
    bandwidth_bytes_per_s: Positive
    """Peak memory bandwidth of one card, for the decode roofline on this card."""
    source: StrictStr
    """Where the figures were read (a recording, a datasheet)."""


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class GpuSpec:
    name: StrictStr
    """Substring of NVML's device name, case-insensitive."""
    count: Positive
    memory_bytes: Positive
    """Nominal memory of one card, used when the facts have no GPUs to read it from."""
    min_memory_bytes: Bytes
    min_compute_capability: StrictStr
    bandwidth_bytes_per_s: Positive
    """Peak memory bandwidth of one card, for the decode roofline."""
    min_pcie_gen: Positive
    min_pcie_width: Positive
    host_link_bytes_per_s: Positive | None = None
    """One card's host link (PCIe) bandwidth, for reads of pinned host memory by the
    GPU: the MTP drafter's routed experts (plan/mtp_projection.py). A figure with its
    source, never a guess; None: not known, and MTP's gain is not projected."""
    other_cards: tuple[OtherCard, ...] = ()
    """Other cards the profile runs on unchanged (a test profile whose lent host may
    be either of two kinds); each is held to the same minimums (min_memory_bytes,
    compute capability, link). Empty: `name` only."""

    @property
    def label(self) -> str:
        """The cards as people read them: "H200" or "H200 or H100"."""
        return " or ".join([self.name, *(c.name for c in self.other_cards)])

    def matches(self, device: GpuDevice) -> bool:
        return self.card(device) is not None

    def card(self, device: GpuDevice) -> OtherCard | GpuSpec | None:
        """Which of the profile's cards `device` is: this spec, an other card, or None."""
        name = device.name.lower()
        if self.name.lower() in name:
            return self
        return next((c for c in self.other_cards if c.name.lower() in name), None)


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class ParallelSpec:
    pipeline_parallel_size: Positive
    tensor_parallel_size: Positive


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class SchedulerSpec:
    max_model_len: Positive
    max_num_seqs: Positive
    max_num_batched_tokens: Positive
    enable_prefix_caching: StrictBool


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class MemorySpec:
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)]
    """Fraction of each card's memory vLLM may use, in (0, 1]."""
    workspace_margin_bytes: Bytes
    """Per card, on top of the weights: kernel workspace, PLE prefetch buffers."""
    pp_buffer_bytes: Bytes
    """Send/receive buffers of one PP hop; middle ranks hold two."""
    activation_reserve_bytes: Bytes
    """Activations of one prefill chunk and captured graphs, per card."""
    kv_cache_memory_bytes_max: Bytes
    """Upper bound on --kv-cache-memory-bytes."""
    host_overhead_bytes: Bytes
    """Host RAM for processes, page tables and staging, beyond the pinned pools."""
    min_shm_bytes: Bytes
    measured_start_peak_bytes: tuple[Bytes, ...] | None = None
    """Per PP rank: the most memory the rank was seen to take while starting, in a
    rank-fit run of its full-width slice (checks/gpu/RESULTS.md). Preflight warns
    when a card has less free; None: no such run for this profile."""
    cuda_context_bytes: Bytes | None = None
    """Device memory a vLLM process holds outside torch's allocator from init_device on
    (CUDA context, library handles, driver mappings): the start peak's per-card
    constant (plan/start_peak.py). None: not known for this card (counted as 0)."""
    cuda_context_source: StrictStr | None = None
    """Where cuda_context_bytes comes from (a result file), and on which card."""


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class CompilationSpec:
    mode: StrictInt
    cudagraph_mode: StrictStr
    cudagraph_capture_sizes: tuple[Positive, ...]


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class QsaOffloadSpec:
    enabled: StrictBool
    max_host_bytes: Bytes
    """Cap on the pinned host K/V arenas of one rank."""
    host_pinning: Literal["exact", "pow2"]
    """"exact" (cudaHostRegister) or "pow2" (PyTorch's pinned allocator rounds up)."""
    chunk_tokens: Positive
    """Tokens per chunk a prefill streams through its VRAM work buffer."""


TABLE_MEDIUM_CHECKS = ("fail", "warn")


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class TableSpec:
    medium_check: Literal["fail", "warn"] = "fail"
    """What preflight makes of a table on a medium `table prepare` refuses (rotational,
    network, RAM, overlay): "fail" (default), or "warn" for a table small enough to
    live in the page cache."""


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class VllmSpec:
    additional_config: dict[str, Any] = field(default_factory=dict)
    """vLLM's --additional-config (one JSON object); empty: the flag is not passed."""


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class CheckpointSpec:
    hub_repo: StrictStr | None = None
    """The Hugging Face repository of the checkpoint the profile serves, for the
    download command preflight suggests; None: not published."""
    skeleton: Literal["full", "tiny"] | None = None
    """The `flashnext skeleton` variant with its exact tensor inventory: without a
    readable --model, preflight sizes host RAM and memlock from it. None: no such
    inventory (host memory then needs --model)."""


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class MtpSpec:
    enabled: StrictBool = False
    """Speculative decoding with the checkpoint's MTP layer: the planner places it on
    the last PP rank (plan/mtp.py) and passes --speculative-config only if it fits."""
    num_speculative_tokens: Positive = 1
    """Draft tokens per step (vLLM's num_speculative_tokens)."""
    acceptance_rate: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None
    """Chance that one draft token is accepted, in [0, 1], for the on-paper projection of
    MTP's gain (plan/mtp_projection.py); a figure read in a public source, never a guess.
    None: no cited rate, and the plan projects nothing."""
    acceptance_source: StrictStr | None = None
    """Where acceptance_rate was read (address and the figure as written there);
    required with acceptance_rate."""

    @model_validator(mode="after")
    def _rate_has_a_source(self) -> MtpSpec:
        if (self.acceptance_rate is None) != (not self.acceptance_source):
            raise ValueError(
                "acceptance_rate and acceptance_source go together: a rate needs the "
                "address it was read at, a source needs its rate"
            )
        return self


@dataclass(frozen=True, config=_FORBID_UNKNOWN)
class Profile:
    name: StrictStr
    description: str
    default: StrictBool
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
    mtp: MtpSpec = field(default_factory=MtpSpec)
    auto_select: StrictBool = True
    """Whether a host with this profile's GPUs gets it without --profile. Test
    profiles set it false: they are chosen by name only."""

    def matches(self, facts: HostFacts) -> bool:
        """The host has exactly the profile's GPUs (count and model)."""
        devices = facts.gpu.devices
        return len(devices) == self.gpu.count and all(self.gpu.matches(d) for d in devices)


REQUIRED_SECTIONS = {
    "gpu": GpuSpec,
    "parallel": ParallelSpec,
    "scheduler": SchedulerSpec,
    "memory": MemorySpec,
    "compilation": CompilationSpec,
    "qsa_offload": QsaOffloadSpec,
}
OPTIONAL_SECTIONS = {
    "table": TableSpec,
    "vllm": VllmSpec,
    "checkpoint": CheckpointSpec,
    "mtp": MtpSpec,
}
# What a value outside its choices means, said the way the profile spells it.
_CHOICES = {
    ("qsa_offload", "host_pinning"): "qsa_offload.host_pinning must be 'exact' or 'pow2'",
    ("table", "medium_check"): "table.medium_check must be 'fail' or 'warn'",
    ("checkpoint", "skeleton"): "checkpoint.skeleton must be 'full' or 'tiny'",
    ("vllm", "additional_config"): "vllm.additional_config must be a table",
    (None, "auto_select"): "auto_select must be true or false",
}


def _explain(exc: ValidationError, section: str | None) -> str:
    """pydantic's errors as one line: missing and unknown keys listed, then each bad value
    with its bound (`memory.gpu_memory_utilization: Input should be less than or equal
    to 1, got 1.5`)."""
    missing, unknown, values = [], [], []
    for err in exc.errors():
        key = str(err["loc"][0]) if err["loc"] else "?"
        if not err["loc"]:  # a check across fields says what clashes itself
            values.append(f"{section or 'profile'}: {err['msg'].removeprefix('Value error, ')}")
        elif err["type"] in ("missing", "missing_argument"):
            missing.append(key)
        elif err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            unknown.append(key)
        elif (section, key) in _CHOICES:
            values.append(_CHOICES[(section, key)])
        else:
            values.append(f"{f'{section}.' if section else ''}{key}: {err['msg']}, "
                          f"got {err['input']!r}")  # fmt: skip
    parts = [f"{label} {', '.join(sorted(set(keys)))}"
             for label, keys in (("missing", missing), ("unknown", unknown)) if keys]  # fmt: skip
    return "; ".join(dict.fromkeys(parts + values))


def _section(cls: type, doc: Any, source: str, key: str) -> Any:
    if not isinstance(doc, dict):
        raise ProfileError(f"{source}: [{key}] must be a table")
    try:
        return cls(**doc)
    except ValidationError as exc:
        raise ProfileError(f"{source} [{key}]: {_explain(exc, key)}") from None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_section(env: Any, source: str) -> dict[str, str]:
    """[env]: variable names to scalar values, as the child's environment takes them.
    A list or table would be stringified into nonsense, a name with `=` splits the
    variable differently in the child; both are refused, named."""
    if not isinstance(env, dict):
        raise ProfileError(f"{source}: [env] must be a table of NAME = value")
    out: dict[str, str] = {}
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise ProfileError(f"{source} [env]: {name!r} is not an environment variable name "
                               "(letters, digits and _, not starting with a digit)")  # fmt: skip
        if isinstance(value, bool):
            value = "1" if value else "0"
        if not isinstance(value, str | int | float):
            raise ProfileError(f"{source} [env]: {name} is a {type(value).__name__}, not a "
                               "string or number; write it as one quoted string")  # fmt: skip
        out[name] = str(value)
    return out


def parse_profile(text: str, source: str) -> Profile:
    """A profile TOML, every field checked against its type and bounds."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{source}: not valid TOML ({exc})") from exc
    absent = [k for k in REQUIRED_SECTIONS if k not in doc]
    if absent:
        raise ProfileError(f"{source}: missing section [{absent[0]}]")
    sections = {**REQUIRED_SECTIONS, **{k: v for k, v in OPTIONAL_SECTIONS.items() if k in doc}}
    built = {k: _section(cls, doc[k], source, k) for k, cls in sections.items()}
    try:
        return Profile(
            name=doc.get("name"),
            description=doc.get("description", ""),
            default=bool(doc.get("default", False)),
            auto_select=doc.get("auto_select", True),
            env=_env_section(doc.get("env", {}), source),
            **built,
        )
    except ValidationError as exc:
        raise ProfileError(f"{source}: {_explain(exc, None)}") from None


def with_mtp(profile: Profile, speculative_tokens: int | None) -> Profile:
    """The profile as `--mtp N` asks: 0 turns MTP off, N > 0 on with N draft tokens
    per step; None leaves the profile's [mtp] as it is."""
    if speculative_tokens is None:
        return profile
    mtp = dataclasses.replace(
        profile.mtp,
        enabled=speculative_tokens > 0,
        num_speculative_tokens=speculative_tokens or profile.mtp.num_speculative_tokens,
    )
    return dataclasses.replace(profile, mtp=mtp)


def check_profile_name(name: str | None, profiles: dict[str, Profile] | None = None) -> str | None:
    """`name` when a profile of that name is shipped (or None); ProfileError otherwise."""
    profiles = available_profiles() if profiles is None else profiles
    if name is not None and name not in profiles:
        raise ProfileError(f"unknown profile {name!r}; available: {', '.join(sorted(profiles))}")
    return name


def available_profiles() -> dict[str, Profile]:
    """Every profile shipped with the launcher, by name."""
    found: dict[str, Profile] = {}
    for entry in resources.files(__name__).iterdir():
        if entry.name.endswith(".toml"):
            profile = parse_profile(entry.read_text(), entry.name)
            found[profile.name] = profile
    return found


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
