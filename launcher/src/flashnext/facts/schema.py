"""HostFacts: what the probes saw, as frozen dataclasses with a versioned JSON form.

Probes (host.py, gpu.py, storage.py) are the only code that touches the host.
Everything downstream (checks, plan) is a pure function of these records, so a
user's `flashnext facts --json` can be replayed anywhere with `--facts FILE`.

Conventions: sizes in bytes (`*_bytes`), `None` means "unlimited" where the
field says so and "could not be read" elsewhere; a probe that fails records
`error` instead of raising.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


class FactsSchemaError(ValueError):
    """A facts document that this launcher cannot read."""


class ModelFactsError(ValueError):
    """A model directory this launcher cannot read; the message names the file and the fix."""

    def __init__(self, message: str, missing_dir: bool = False, fix: str | None = None) -> None:
        super().__init__(message)
        self.missing_dir = missing_dir
        """The directory itself does not exist (a wrong path, or not downloaded yet)."""
        self.fix = fix
        """The fix alone (the message ends with it too), where it is not a download:
        preflight shows it instead of its own; None: the message says it."""


@dataclass(frozen=True)
class MemoryFacts:
    mem_total_bytes: int | None = None
    """MemTotal from /proc/meminfo."""
    mem_available_bytes: int | None = None
    """MemAvailable from /proc/meminfo: what can be allocated without swapping."""
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None
    hugepages_total: int | None = None
    hugepages_free: int | None = None
    hugepage_size_bytes: int | None = None
    cgroup_version: str | None = None
    """"v1", "v2", or None when the process is in no memory cgroup."""
    cgroup_memory_limit_bytes: int | None = None
    """memory.max (v2) / memory.limit_in_bytes (v1) of this process; None = no limit."""
    memlock_soft_bytes: int | None = None
    """RLIMIT_MEMLOCK soft limit; None = unlimited."""
    memlock_hard_bytes: int | None = None
    """RLIMIT_MEMLOCK hard limit; None = unlimited."""
    shm_total_bytes: int | None = None
    """Size of /dev/shm (statvfs); None when /dev/shm is missing."""
    shm_free_bytes: int | None = None
    ptrace_scope: int | None = None
    """kernel.yama.ptrace_scope; None when Yama is not built in."""
    cpu_count: int | None = None
    """CPUs this process may run on (sched_getaffinity)."""
    error: str | None = None
    unknown: tuple[str, ...] = ()
    """Fields whose value is not known: the probe failed, or a replayed facts file
    lacks them. Their None then means "unknown", never "unlimited" or "no limit"."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_capability: str
    """"major.minor", e.g. "8.6" for the RTX 3090."""
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    persistence_mode: bool | None = None
    processes: tuple[GpuProcess, ...] = ()
    """Compute and graphics processes NVML reports on this GPU."""
    pci_bus_id: str | None = None
    """PCI address as sysfs names it, "0000:01:00.0" (from NVML's busId)."""
    numa_node: int | None = None
    """NUMA node of the GPU's PCIe root (sysfs numa_node); None when the platform
    gives none (-1: one node, as on single-socket boards) or it was not read."""


@dataclass(frozen=True)
class P2PLink:
    gpu_a: int
    gpu_b: int
    status: str
    """NVML's P2P read status: "ok", "chipset_not_supported", "topology_not_supported", ..."""


@dataclass(frozen=True)
class GpuFacts:
    nvml_available: bool = False
    error: str | None = None
    """Why NVML could not be used (no library, no driver, init failed)."""
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    """CUDA version the driver supports, "12.8"."""
    devices: tuple[GpuDevice, ...] = ()
    p2p: tuple[P2PLink, ...] = ()


@dataclass(frozen=True)
class BlockDevice:
    """A leaf block device (a disk, after partitions and dm/md stacks are resolved)."""

    name: str
    rotational: bool | None = None
    transport: str = "unknown"
    """nvme, sata, scsi, usb, virtio, mmc, network, ram, loop, unknown."""
    model: str | None = None


@dataclass(frozen=True)
class ManifestFacts:
    """The PLE table's manifest (TABLE.json beside the flat file), as read; judged by preflight."""

    path: str
    exists: bool = False
    doc: dict[str, Any] | None = None
    """The manifest's JSON object; None when it is missing or could not be read."""
    error: str | None = None
    """Why it could not be read: I/O error, not JSON, not an object."""


@dataclass(frozen=True)
class StorageFacts:
    path: str
    exists: bool = False
    is_regular_file: bool = False
    size_bytes: int | None = None
    """File size of `path` when it is a regular file."""
    readable: bool = False
    mount_point: str | None = None
    fs_type: str | None = None
    mount_source: str | None = None
    network: bool = False
    """A network filesystem (nfs, cifs, ceph, 9p, fuse.sshfs, ...)."""
    devices: tuple[BlockDevice, ...] = ()
    """Leaf block devices backing the mount (empty for tmpfs/overlay/network)."""
    free_bytes: int | None = None
    error: str | None = None
    manifest: ManifestFacts | None = None
    """Role "table" only: the manifest beside the file (what vLLM reads to learn its
    layout). None: not probed (other roles; facts from before manifests were read)."""

    @property
    def transport(self) -> str:
        """One word for the medium: the leaves' transport if they agree, else "mixed"."""
        if self.network:
            return "network"
        kinds = {d.transport for d in self.devices}
        if not kinds:
            return "none"
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def rotational(self) -> bool | None:
        """True if any leaf spins; None if unknown."""
        flags = [d.rotational for d in self.devices]
        if any(f is True for f in flags):
            return True
        if flags and all(f is False for f in flags):
            return False
        return None


@dataclass(frozen=True)
class PortFacts:
    host: str
    port: int
    free: bool
    error: str | None = None


@dataclass(frozen=True)
class NumaFacts:
    nodes: tuple[int, ...] = ()
    """Online NUMA nodes (/sys/devices/system/node/online); empty: not known."""
    mems_allowed: tuple[int, ...] = ()
    """Nodes this process may allocate from (/proc/self/status Mems_allowed_list), and
    so vLLM's pinned K/V pools; empty: not known."""
    error: str | None = None


@dataclass(frozen=True)
class VllmEnvFacts:
    """The vLLM that `serve` would start (facts/vllm_env.py). Always probed on this
    machine, also when host facts are replayed: serve execs it here."""

    selected_by: str
    """How it was chosen: "--vllm-env", "FLASHNEXT_VLLM_ENV", "PATH", "pins/build-env"
    (the checkout's pinned env, already built) or "none"."""
    env_dir: str | None = None
    """The env directory given or found (pins/build-env's ENV); None for PATH."""
    executable: str | None = None
    """The `vllm` executable serve runs."""
    python: str | None = None
    """The Python that runs it (ENV/venv/bin/python, or the script's interpreter)."""
    package_dir: str | None = None
    """Where that Python imports `vllm` from (PYTHONPATH honoured)."""
    version: str | None = None
    """`vllm.__version__` as that Python imports it."""
    stamp: dict[str, Any] | None = None
    """PACKAGE_DIR/_flashnext_patches.json (written by patches/apply); None: stock."""
    stamp_error: str | None = None
    """Why the stamp exists but could not be read."""
    error: str | None = None
    """Why the env could not be asked at all (no python, `import vllm` failed, ...)."""


@dataclass(frozen=True)
class HostFacts:
    schema_version: int = SCHEMA_VERSION
    collected_at: str = ""
    hostname: str = ""
    kernel: str = ""
    in_container: bool = False
    memory: MemoryFacts = field(default_factory=MemoryFacts)
    gpu: GpuFacts = field(default_factory=GpuFacts)
    storage: dict[str, StorageFacts] = field(default_factory=dict)
    """Keyed by role: "table" (the PLE flat file), "model" (the checkpoint dir)."""
    ports: tuple[PortFacts, ...] = ()
    numa: NumaFacts = field(default_factory=NumaFacts)
    """Empty in facts recorded before NUMA was probed."""


# ---------------------------------------------------------------- JSON form


def to_jsonable(obj: Any) -> Any:
    """Dataclasses → dicts (recursively); tuples → lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(to_jsonable(obj), sort_keys=True, indent=2) + "\n"


@functools.cache
def _host_facts_adapter() -> Any:
    """pydantic's validator for HostFacts, built once and only when a facts file is read:
    every dataclass under it strict (an integer is an integer, not "12") and closed (a
    key it does not declare is refused)."""
    from pydantic import ConfigDict, TypeAdapter

    todo, seen = [HostFacts], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        cls.__pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[attr-defined]
        for hint in typing.get_type_hints(cls).values():
            stack = [hint]
            while stack:
                tp = stack.pop()
                if dataclasses.is_dataclass(tp):
                    todo.append(tp)
                stack.extend(typing.get_args(tp))
    return TypeAdapter(HostFacts)


def _validated(doc: dict[str, Any], source: str) -> HostFacts:
    from pydantic import ValidationError

    body = {k: v for k, v in doc.items() if k != "schema_version"}
    try:
        return _host_facts_adapter().validate_json(json.dumps(body))
    except ValidationError as exc:
        raise FactsSchemaError(_explain(exc, source)) from None


def _explain(exc: Any, source: str) -> str:
    """pydantic's errors, each at its path (`facts.json.memory: unknown field(s) bogus`)."""
    grouped: dict[tuple[str, str], list[str]] = {}
    problems: list[str] = []
    for err in exc.errors():
        *parent, last = [str(p) for p in err["loc"]] or ["?"]
        where = ".".join([source, *parent])
        if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            grouped.setdefault((where, "unknown field(s)"), []).append(last)
        elif err["type"] in ("missing", "missing_argument"):
            grouped.setdefault((where, "missing field(s)"), []).append(last)
        else:
            problems.append(f"{where}.{last}: {err['msg']}, got {err['input']!r}")
    lines = [f"{w}: {what} {', '.join(sorted(n))}" for (w, what), n in grouped.items()]
    return "; ".join(lines + problems[:5])


def host_facts_from_json(text: str, source: str = "facts") -> HostFacts:
    """Parse a facts document, refusing versions this launcher does not know."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FactsSchemaError(f"{source}: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise FactsSchemaError(f"{source}: expected a JSON object")
    return host_facts_from_doc(doc, source)


def host_facts_from_file(path: str) -> HostFacts:
    """A facts file (--facts): a small UTF-8 JSON object, else FactsSchemaError with the fix."""
    from flashnext.facts.jsonfile import JsonFileError, read_json_object

    try:
        doc = read_json_object(path, "facts file")
    except JsonFileError as exc:
        raise FactsSchemaError(
            f"{exc}; record facts with `flashnext facts --out FILE` and pass that FILE"
        ) from None
    return host_facts_from_doc(doc, path)


def host_facts_from_doc(doc: dict[str, Any], source: str = "facts") -> HostFacts:
    """A parsed facts document, refusing versions this launcher does not know."""
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise FactsSchemaError(
            f"{source}: schema_version {version!r}, this flashnext reads version "
            f"{SCHEMA_VERSION}; re-run `flashnext facts --json` with this flashnext"
        )
    facts = _validated(doc, source)
    # A field the file does not carry is unknown: for memory limits, None would
    # otherwise read as "unlimited" / "no limit".
    memory = doc.get("memory")
    absent = [f for f in _RECORDED_MEMORY_FIELDS if not isinstance(memory, dict) or f not in memory]
    if absent:
        unknown = tuple(sorted({*facts.memory.unknown, *absent}))
        facts = dataclasses.replace(
            facts, memory=dataclasses.replace(facts.memory, unknown=unknown)
        )
    return facts


_RECORDED_MEMORY_FIELDS = tuple(
    f.name for f in dataclasses.fields(MemoryFacts) if f.name not in ("error", "unknown")
)


# ---------------------------------------------------------------- model facts
# Read from a checkpoint directory without touching tensor data (facts/model.py).


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    """safetensors dtype tag: "BF16", "I32", "I8", "F32", "I64", ..."""
    shape: tuple[int, ...]
    nbytes: int
    file: str
    """Shard file name (relative to the model dir)."""
    offset_bytes: int = -1
    """Absolute offset of the tensor's first byte in `file` (8 + header length +
    data_offsets[0]); -1 for inventories that were not read from files."""


# A routed expert's tensors differ from expert 0's only in the expert number: one
# class stands for all 512, so the plan places a few thousand names, not 225k.
_EXPERT_NUMBER = re.compile(r"\.experts\.\d+\.")


def tensor_class(name: str) -> str:
    """`name` with the expert number as `*` (`layers.3.mlp.experts.*.down_proj.weight`);
    every other part, the layer number included, is kept."""
    return _EXPERT_NUMBER.sub(".experts.*.", name)


def bytes_by_class(names: Iterable[str], nbytes: Iterable[int]) -> dict[str, int]:
    """Bytes per tensor_class. One regex pass over all the names joined, and the
    (class, size) pairs counted in C: a class's tensors nearly all have one size."""
    names = list(names)
    if not names:
        return {}
    classes = _EXPERT_NUMBER.sub(".experts.*.", "\n".join(names)).split("\n")
    totals: dict[str, int] = {}
    for (cls, n), count in Counter(zip(classes, nbytes, strict=True)).items():
        totals[cls] = totals.get(cls, 0) + n * count
    return totals


class LazyTensors(Sequence[TensorInfo]):
    """A checkpoint's TensorInfos, built by `load` when first indexed or iterated;
    `len()` is known up front. Planning needs only byte totals, so `flashnext plan`
    never builds the 225k objects; `checkpoint check` does."""

    def __init__(self, count: int, load: Callable[[], Iterable[TensorInfo]]) -> None:
        self._count = count
        self._load: Callable[[], Iterable[TensorInfo]] | None = load
        self._items: tuple[TensorInfo, ...] | None = None

    def _all(self) -> tuple[TensorInfo, ...]:
        if self._items is None:
            assert self._load is not None
            self._items = tuple(self._load())
            self._load = None
            if len(self._items) != self._count:
                raise ModelFactsError(
                    f"the checkpoint changed while it was read ({self._count} tensors, then "
                    f"{len(self._items)}); run the command again"
                )
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # type: ignore[override]
        return self._all()[index]

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTensors):
            return self._all() == other._all()
        return isinstance(other, tuple) and self._all() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LazyTensors({self._count} tensors)"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    file_size_bytes: int
    header_bytes: int
    """Length of the JSON header (the 8-byte prefix not included)."""
    tensor_count: int


@dataclass(frozen=True)
class ModelFacts:
    path: str
    config: dict[str, Any]
    """config.json as published (top level; the text part is `text_config`)."""
    quantization_config: dict[str, Any] | None
    generation_config: dict[str, Any] | None
    """generation_config.json, or None when the file is absent."""
    index_files: tuple[str, ...]
    """Shard files named by model.safetensors.index.json (or the single file)."""
    shards: tuple[ShardInfo, ...]
    tensors: Sequence[TensorInfo]
    """Every tensor, in shard and header order (a LazyTensors when read from a
    directory: built when first iterated; len() never builds them)."""
    byte_classes: dict[str, int] | None = field(default=None, compare=False, repr=False)
    """bytes_by_class(tensors), when the reader already has it (cached or counted)."""

    def tensor_bytes_by_class(self) -> dict[str, int]:
        """Tensor bytes summed by tensor_class(name): what the plan places."""
        if self.byte_classes is not None:
            return self.byte_classes
        return bytes_by_class((t.name for t in self.tensors), (t.nbytes for t in self.tensors))

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config)

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.config.get("architectures") or ())

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")
