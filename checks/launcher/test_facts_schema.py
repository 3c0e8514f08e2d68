"""A replayed facts file is checked by pydantic against the facts dataclasses: strict
types, no unknown keys, and every problem said at its path."""

from __future__ import annotations

import pytest
from flashnext.facts.schema import FactsSchemaError, dumps, host_facts_from_json
from lead_fixtures import base_facts


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"schema_version": 1, "memory": {"bogus": 1}}',
         "f.json.memory: unknown field(s) bogus"),
        ('{"schema_version": 1, "memory": {"mem_total_bytes": "12"}}',
         "f.json.memory.mem_total_bytes: Input should be a valid integer, got '12'"),
        ('{"schema_version": 1, "memory": {"mem_total_bytes": true}}',
         "f.json.memory.mem_total_bytes: Input should be a valid integer, got True"),
        ('{"schema_version": 1, "gpu": {"devices": [{"index": 0, "name": "x"}]}}',
         "f.json.gpu.devices.0: missing field(s) compute_capability, memory_free_bytes, "
         "memory_total_bytes, uuid"),
    ],
)  # fmt: skip
def test_a_bad_facts_file_is_refused_at_the_path(text, message):
    with pytest.raises(FactsSchemaError) as err:
        host_facts_from_json(text, "f.json")
    assert str(err.value) == message


def test_recorded_facts_replay_to_the_same_facts():
    facts = base_facts()
    assert host_facts_from_json(dumps(facts)) == facts
