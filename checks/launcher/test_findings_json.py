"""`preflight --json` findings carry their sizes as numbers of bytes beside the display
strings; ids, levels and the envelope keys are what other tools parse: unchanged."""

from __future__ import annotations

import json

from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.schema import dumps
from lead_fixtures import VARIANTS, base_facts

TABLE = "/nvme/flashnext/ple-table.bin"


def preflight_json(tmp_path, facts, model_dir) -> dict:
    path = tmp_path / "facts.json"
    path.write_text(dumps(facts))
    args = ["preflight", "--json", "--facts", str(path), "--model", str(model_dir),
            "--table", TABLE]  # fmt: skip
    result = CliRunner().invoke(main, args)
    return json.loads(result.stdout)


def test_sizes_are_bytes_and_the_envelope_is_unchanged(tmp_path, full_skeleton):
    change, _, _, _ = VARIANTS["memlock_64k"]
    doc = preflight_json(tmp_path, change(base_facts()), full_skeleton)
    assert {"findings", "plan", "result", "facts", "profile"} <= set(doc)
    assert doc["result"] == "fail"
    found = {f["id"]: f for f in doc["findings"]}
    memlock = found["host.memlock"]
    assert (memlock["level"], memlock["measured_bytes"]) == ("fail", 65536)
    assert memlock["required_bytes"] == doc["plan"]["pinned_bytes_needed"] > 0
    assert memlock["measured"] == "64 KiB"  # the display string is kept
    ram = found["host.ram"]
    assert ram["measured_bytes"] == base_facts().memory.mem_available_bytes
    assert ram["required_bytes"] == doc["plan"]["host_ram_needed_bytes"]
    for rank in (0, 1, 2):
        vram = found[f"rank{rank}.vram"]
        assert vram["measured_bytes"] == doc["plan"]["ranks"][rank]["committed_bytes"]
        assert vram["required_bytes"] == doc["plan"]["ranks"][rank]["vram_usable_bytes"]
    # a finding that is not about a size says so with null, not a made-up number
    assert found["pp.ple_rank"]["measured_bytes"] is None
