"""Issue 13, finding 10: the GPU topology is probed and judged, and sets NCCL's env.

RTX 3090s have no PCIe P2P (NVML: chipset_not_supported), so PP traffic goes
through host memory: preflight reports the P2P matrix and each GPU's NUMA node,
warns when the GPUs and the pinned pools can sit on different nodes of a
multi-socket host, and the plan sets NCCL_P2P_DISABLE=1, saying why.
"""

from __future__ import annotations

import dataclasses

from click.testing import CliRunner
from flashnext.assess import assess
from flashnext.cli import main
from flashnext.facts.gpu import numa_node_of, sysfs_bus_id
from flashnext.facts.host import parse_cpulist, probe_numa
from flashnext.facts.schema import NumaFacts, P2PLink, dumps
from flashnext.plan.planner import PlanOptions
from lead_fixtures import VARIANTS, base_facts, split_shell_line

TABLE = "/nvme/flashnext/ple-table.bin"
NO_P2P = (
    "NVML reports no PCIe P2P between GPUs 0-1 (chipset_not_supported), 0-2 "
    "(chipset_not_supported), 1-2 (chipset_not_supported): PP activations go through host "
    "memory (NCCL's shared-memory transport); disabling P2P keeps NCCL from probing a path "
    "the GPUs do not have"
)


def findings(facts, model=None, model_dir=None):
    a = assess(facts, PlanOptions(model_dir=model_dir, table_path=TABLE), None, model=model)
    return {f.id: f for f in a.findings}, a


# ---------------------------------------------------------------- probes


def test_each_gpus_numa_node_from_sysfs(tmp_path):
    for bus, node in (("0000:01:00.0", "0"), ("0000:81:00.0", "1"), ("0000:02:00.0", "-1")):
        d = tmp_path / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    assert sysfs_bus_id("00000000:81:00.0") == "0000:81:00.0"
    assert numa_node_of("0000:01:00.0", str(tmp_path)) == 0
    assert numa_node_of("0000:81:00.0", str(tmp_path)) == 1
    assert numa_node_of("0000:02:00.0", str(tmp_path)) is None  # -1: no affinity
    assert numa_node_of("0000:03:00.0", str(tmp_path)) is None  # not there


def test_the_replayed_3090s_carry_bus_ids_and_nodes(tmp_path):
    from test_probe_gpu import ReplayNVML, machine

    for i, node in enumerate((0, 0, 1)):
        d = tmp_path / "bus" / "pci" / "devices" / f"0000:{i + 1:02x}:00.0"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    from flashnext.facts.gpu import probe_gpus

    facts = probe_gpus(ReplayNVML(machine()), sys=str(tmp_path))
    assert [(d.pci_bus_id, d.numa_node) for d in facts.devices] == [
        ("0000:01:00.0", 0), ("0000:02:00.0", 0), ("0000:03:00.0", 1)
    ]  # fmt: skip


def test_host_numa_nodes_and_what_this_process_may_allocate_on(tmp_path):
    (tmp_path / "sys" / "devices" / "system" / "node").mkdir(parents=True)
    (tmp_path / "sys" / "devices" / "system" / "node" / "online").write_text("0-1\n")
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "status").write_text(
        "Name:\tpython3\nMems_allowed:\t00000000,00000003\nMems_allowed_list:\t1\n"
    )
    assert probe_numa(str(tmp_path / "proc"), str(tmp_path / "sys")) == NumaFacts(
        nodes=(0, 1), mems_allowed=(1,)
    )
    assert parse_cpulist("0-2,5") == (0, 1, 2, 5)
    missing = probe_numa(str(tmp_path / "nope"), str(tmp_path / "nope"))
    assert missing.nodes == () and "node/online" in missing.error


# ---------------------------------------------------------------- preflight


def test_the_p2p_matrix_and_numa_are_reported(full_model):
    found, _ = findings(base_facts(), full_model)
    p2p = found["gpu.p2p"]
    assert (p2p.level, p2p.measured) == ("ok", "no P2P on 3 of 3 pairs")
    assert p2p.message == (
        "P2P reads: 0-1 chipset_not_supported, 0-2 chipset_not_supported, 1-2 "
        "chipset_not_supported: PP activations go through host memory (NCCL's shared-memory "
        "transport), so the plan sets NCCL_P2P_DISABLE=1"
    )
    numa = found["gpu.numa"]
    assert (numa.level, numa.measured) == ("ok", "1 NUMA node")
    assert numa.message == (
        "one NUMA node: the pinned pools and the GPUs share it (GPU0 node -, GPU1 node -, "
        "GPU2 node -)"
    )


def test_a_two_socket_host_without_binding_warns_with_the_numactl_line(full_model):
    found, _ = findings(VARIANTS["two_sockets_unbound"][0](base_facts()), full_model)
    f = found["gpu.numa"]
    assert (f.level, f.measured) == ("warn", "GPUs on node 0, pools on [0, 1]")
    assert f.fix == (
        "start serve bound to node 0: `numactl --cpunodebind=0 --membind=0 flashnext serve ...` "
        "(podman/docker: --cpuset-mems=0 and that node's CPUs in --cpuset-cpus)"
    )
    bound = VARIANTS["two_sockets_unbound"][0](base_facts())
    bound = dataclasses.replace(bound, numa=NumaFacts(nodes=(0, 1), mems_allowed=(0,)))
    f = findings(bound, full_model)[0]["gpu.numa"]
    assert (f.level, f.measured) == ("ok", "bound to node 0")


def test_gpus_split_over_two_sockets_warn(full_model):
    f = findings(VARIANTS["gpus_on_two_sockets"][0](base_facts()), full_model)[0]["gpu.numa"]
    assert (f.level, f.measured) == ("warn", "GPUs on nodes [0, 1]")
    assert "GPU0 node 0, GPU1 node 0, GPU2 node 1" in f.message


def test_facts_without_topology_warn():
    found, _ = findings(dataclasses.replace(base_facts(), numa=NumaFacts()))
    assert found["gpu.numa"].level == "warn" and "NUMA nodes" in found["gpu.numa"].message


# ---------------------------------------------------------------- the plan's NCCL env


def test_the_plan_disables_nccl_p2p_and_says_why(full_model):
    _, a = findings(base_facts(), full_model)
    assert a.plan.env["NCCL_P2P_DISABLE"] == "1"
    assert a.plan.env_reasons == {"NCCL_P2P_DISABLE": NO_P2P}
    assert a.plan.to_json()["env_reasons"] == {"NCCL_P2P_DISABLE": NO_P2P}


def test_nothing_is_set_when_the_gpus_have_p2p_or_the_topology_is_unknown(full_model):
    facts = base_facts()
    ok = tuple(dataclasses.replace(p, status="ok") for p in facts.gpu.p2p)
    for p2p in (ok, (), (P2PLink(0, 1, "unknown"),)):
        changed = dataclasses.replace(facts, gpu=dataclasses.replace(facts.gpu, p2p=p2p))
        _, a = findings(changed, full_model)
        assert "NCCL_P2P_DISABLE" not in a.plan.env and a.plan.env_reasons == {}


def test_the_dry_run_and_the_plan_table_carry_it(full_skeleton, tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(dumps(base_facts()))
    args = ["--facts", str(facts), "--model", str(full_skeleton), "--table", TABLE]
    dry = CliRunner().invoke(main, ["serve", "--dry-run", "--replay-facts-for-testing", *args[1:]])
    env, _ = split_shell_line(dry.stdout.splitlines()[-1])
    assert env["NCCL_P2P_DISABLE"] == "1"
    plan = CliRunner().invoke(main, ["plan", *args]).stdout
    assert f"note: NCCL_P2P_DISABLE=1: {NO_P2P}" in " ".join(plan.split())
