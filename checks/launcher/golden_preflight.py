"""The golden files of `flashnext preflight`: its human table and its --json, byte for byte.

Each case is replayed facts (checks/fixtures/facts/3x3090-nvme.json, changed by the
named lead_fixtures.VARIANTS, or made the lent H200 host of h200_tiny_facts.py), a
skeleton checkpoint and the command's arguments; together the cases reach every
preflight domain (GPUs, host memory, the plan's rank fit and KV pool, MTP, the
model, the table, the vLLM env, the port), passing and failing. Everything a case
reads is written into one work directory and named relative to it, and that
directory's path (and this checkout's) is replaced by WORK (REPO), so no temp path
leaks in. test_golden_preflight.py compares; `checks/launcher/golden/preflight/regenerate`
rewrites them (then read the diff).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner
from flashnext.cli import main as cli
from flashnext.facts.schema import HostFacts, dumps
from flashnext.skeleton import write_skeleton
from h200_tiny_facts import h200_gpu, h200_memory
from lead_fixtures import BASE_FILE, VARIANTS, base_facts
from vllm_env_fixtures import checkout_stamp, make_vllm_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GOLDEN_DIR = HERE / "golden" / "preflight"
TABLE = "/nvme/flashnext/ple-table.bin"  # the path the replayed facts record
FULL = "Qwen3.8-Flash-Next"  # full skeleton, fixed metadata
SHIPPED = "shipped-tiny"  # tiny skeleton with the shipped export defects
TINY = "tiny"  # tiny skeleton, fixed metadata
PATCHED_ENV = "vllm-patched"  # stand-in env stamped with this checkout's series
STOCK_ENV = "vllm-stock"  # stand-in env without the patch stamp
STALE_ENV = "vllm-stale"  # stand-in env stamped with a series that lost its last patch
NEUTRAL_GENERATION = "generation-neutral"  # a generation_config.json restoring nothing


def _varied(*names: str) -> Callable[[], HostFacts]:
    """The base facts with each named lead_fixtures variant applied, in order."""

    def facts() -> HostFacts:
        f = base_facts()
        for name in names:
            f = VARIANTS[name][0](f)
        return f

    return facts


def _memory_unknown() -> HostFacts:
    """No NVML, the table on NFS, and a facts file that lacks the memory limits."""
    f = _varied("no_nvml", "table_on_nfs")()
    unknown = ("mem_available_bytes", "memlock_soft_bytes", "cgroup_memory_limit_bytes",
               "shm_total_bytes")  # fmt: skip
    memory = dataclasses.replace(
        f.memory, mem_available_bytes=None, memlock_soft_bytes=None,
        cgroup_memory_limit_bytes=None, shm_total_bytes=None, unknown=unknown,
    )  # fmt: skip
    return dataclasses.replace(f, memory=memory)


def _h200_doc() -> dict:
    """The 3x3090 fixture made the lent H200 host (its GPU and memory, h200_tiny_facts)."""
    doc = json.loads(BASE_FILE.read_text())
    doc["gpu"] = h200_gpu()
    doc["memory"] = h200_memory(doc["memory"])
    return doc


@dataclass(frozen=True)
class Case:
    facts: Callable[[], str]
    """The facts file's text."""
    args: tuple[str, ...]
    """preflight's arguments after --facts FILE (relative to the work directory)."""
    vllm_env: str = PATCHED_ENV
    """FLASHNEXT_VLLM_ENV: the stand-in env preflight judges."""
    table: bool = True
    """Whether the human table is a golden file too: not where a message names a temp
    path (the vLLM package's), whose length moves the table's wrapping."""


def _text(facts: Callable[[], HostFacts]) -> Callable[[], str]:
    return lambda: dumps(facts())


def _raw_fixture() -> str:
    return BASE_FILE.read_text()


def _h200_text() -> str:
    return json.dumps(_h200_doc(), indent=2, sort_keys=True) + "\n"


MODEL_AND_TABLE = ("--model", FULL, "--table", TABLE)

CASES: dict[str, Case] = {
    # The fixture file as recorded (no manifest, no NUMA facts): warnings that say so.
    "3x3090-recorded": Case(_raw_fixture, MODEL_AND_TABLE),
    # The reference host: every check passes but kv.capacity's warning.
    "3x3090-pass": Case(_text(_varied()), MODEL_AND_TABLE),
    # GPUs and host memory failing one way each, the port taken.
    "3x3090-gpu-host-fail": Case(
        _text(
            _varied(
                "busy_gpu",
                "old_arch",
                "pcie_gen3",
                "gpu_unreadable",
                "gpus_on_two_sockets",
                "low_ram",
                "memlock_64k",
                "cgroup_8g",
                "small_shm",
                "port_busy",
            )
        ),
        MODEL_AND_TABLE,
    ),
    # A 12 GiB card: the ranks and the KV pool do not fit; the table truncated.
    "3x3090-rank-table-fail": Case(
        _text(
            _varied(
                "small_vram",
                "pcie_x8",
                "p2p_not_recorded",
                "two_sockets_unbound",
                "table_truncated",
                "port_unbindable",
            )
        ),
        MODEL_AND_TABLE,
    ),
    # No NVML, memory facts missing from the file, the table on NFS.
    "3x3090-unknown-memory": Case(_text(_memory_unknown), MODEL_AND_TABLE),
    # The shipped checkpoint's defects (quantization groups, sampling keys).
    "3x3090-shipped-tiny": Case(_text(_varied()), ("--model", SHIPPED, "--table", TABLE)),
    # No model and no table: the host checks have no plan to size them.
    "3x3090-no-model": Case(_text(_varied("table_on_sata_ssd")), ()),
    # A table the facts do not describe; the MTP drafter asked for (BF16 experts).
    "3x3090-mtp-other-table": Case(
        _text(_varied("table_on_usb")),
        ("--model", FULL, "--table", "/data/other-table.bin", "--mtp", "1"),
    ),
    # --vllm-env (here FLASHNEXT_VLLM_ENV) names no directory.
    "3x3090-vllm-missing": Case(_text(_varied()), MODEL_AND_TABLE, vllm_env="no-such-env"),
    # vLLM without the patch stamp, then with another series' stamp.
    "3x3090-vllm-stock": Case(_text(_varied()), MODEL_AND_TABLE, vllm_env=STOCK_ENV, table=False),
    "3x3090-vllm-stale": Case(_text(_varied()), MODEL_AND_TABLE, vllm_env=STALE_ENV, table=False),
    # The H200 host under its profile, with a --generation-config that restores nothing.
    "h200-tiny": Case(
        _h200_text,
        (
            "--profile",
            "h200-tiny",
            "--model",
            TINY,
            "--table",
            TABLE,
            "--generation-config",
            NEUTRAL_GENERATION,
        ),
    ),
    # The tiny checkpoint asked for MTP on the H200.
    "h200-tiny-mtp": Case(
        _h200_text, ("--profile", "h200-tiny", "--model", TINY, "--table", TABLE, "--mtp", "1")
    ),
    # The same host under the default profile: its GPUs are not 3x RTX 3090.
    "h200-as-3x3090": Case(_h200_text, ("--model", TINY, "--table", TABLE)),
}


def write_inputs(work: Path) -> None:
    """Every case's facts file, the skeletons, the stand-in envs and the
    generation config, into `work`."""
    for name, case in CASES.items():
        (work / f"{name}.facts.json").write_text(case.facts())
    write_skeleton(work / FULL, "full", fixed_metadata=True)
    write_skeleton(work / SHIPPED, "tiny", fixed_metadata=False)
    write_skeleton(work / TINY, "tiny", fixed_metadata=True)
    stamp = checkout_stamp()
    make_vllm_env(work / PATCHED_ENV, stamp=stamp)
    make_vllm_env(work / STOCK_ENV, stamp=None)
    make_vllm_env(work / STALE_ENV, stamp={**stamp, "patches": stamp["patches"][:-1]})
    (work / NEUTRAL_GENERATION).mkdir()
    (work / NEUTRAL_GENERATION / "generation_config.json").write_text('{"top_k": 0}\n')


def _env(work: Path, case: Case) -> dict[str, str | None]:
    """Only what the case says: no FLASHNEXT_* of the caller, no forced colour or width."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("FLASHNEXT_")}
    for name in ("FORCE_COLOR", "NO_COLOR", "COLUMNS", "LINES", "TTY_COMPATIBLE",
                 "TTY_INTERACTIVE"):  # fmt: skip
        env[name] = None
    env["FLASHNEXT_VLLM_ENV"] = case.vllm_env  # relative: a temp path would change the wrapping
    env["XDG_CACHE_HOME"] = str(work / "cache")
    return env


def _normalized(text: str, work: Path) -> str:
    """Temp and checkout paths named, and the patch series' size and last name, so a
    patch added to the series leaves the files as they are (the count keeps its width:
    the table wraps the same)."""
    series = checkout_stamp()["patches"]
    count = str(len(series))
    for old, new in (
        (str(work.resolve()), "WORK"),
        (str(work), "WORK"),
        (str(REPO), "REPO"),
        (f"{count} patches", f"{'N' * len(count)} patches"),
        (f"the {count}", f"the {'N' * len(count)}"),  # wrapped before "patches"
        (series[-1]["name"], "LAST.patch"),
    ):
        text = text.replace(old, new)
    return text


def run_case(work: Path, name: str) -> dict[str, str]:
    """File name → exact text: the case's table (`NAME.txt`: stdout, then the exit
    status) and its --json (`NAME.json`). Run with `work` as the current directory."""
    case = CASES[name]
    args = ["preflight", "--facts", f"{name}.facts.json", *case.args]
    files = {}
    for suffix, extra in (("txt", []), ("json", ["--json"]))[0 if case.table else 1 :]:
        result = CliRunner().invoke(cli, args + extra, env=_env(work, case))
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            name,
            result.output,
        )
        text = f"{result.stdout}exit {result.exit_code}\n"
        files[f"{name}.{suffix}"] = _normalized(text, work)
    return files


def golden_files(work: Path) -> dict[str, str]:
    """Every case's files (write_inputs first; `work` the current directory)."""
    return {file: text for name in CASES for file, text in run_case(work, name).items()}


def main() -> None:
    """Write the inputs into a temporary directory, run every case there, rewrite the files."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_inputs(work)
        os.chdir(work)
        files = golden_files(work)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for stale in set(p.name for p in GOLDEN_DIR.glob("*.txt")) | set(
        p.name for p in GOLDEN_DIR.glob("*.json")
    ):
        if stale not in files:
            (GOLDEN_DIR / stale).unlink()
    for name, text in files.items():
        (GOLDEN_DIR / name).write_text(text)
        print(f"wrote {GOLDEN_DIR / name}")


if __name__ == "__main__":
    sys.exit(main())
