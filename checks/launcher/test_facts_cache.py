"""The facts cache (facts/header_cache.py) and planning by tensor class: a second read
of a checkpoint reads no header, any change to a file reads them again, and the plan
from class totals equals the plan tensor by tensor."""

from __future__ import annotations

import json
import os
import time

import pytest
from flashnext.facts import header_cache
from flashnext.facts import model as model_module
from flashnext.facts.model import read_model_facts
from flashnext.facts.model_derived import ple_shard_names
from flashnext.facts.schema import LazyTensors, bytes_by_class, tensor_class
from flashnext.plan.placement import place_tensor
from flashnext.plan.planner import weights_per_rank
from flashnext.skeleton import write_skeleton


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "flashnext" / "model-headers"


@pytest.fixture
def aged_model(tmp_path):
    """A tiny checkpoint whose files are older than the racy window."""
    path = tmp_path / "tiny"
    write_skeleton(path, "tiny", fixed_metadata=True)
    age(path, 60)
    return path


def age(path, seconds):
    old = time.time() - seconds
    for f in path.iterdir():
        os.utime(f, (old, old))


def count_header_reads(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = model_module.read_shard_header

    def counting(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(model_module, "read_shard_header", counting)
    return calls


def test_a_second_read_reads_no_header_and_says_the_same(aged_model, cache, monkeypatch):
    first = read_model_facts(aged_model)
    first_tensors = tuple(first.tensors)
    assert len(list(cache.glob("*.json"))) == 1
    calls = count_header_reads(monkeypatch)
    second = read_model_facts(aged_model)
    assert calls == []
    assert second.shards == first.shards and second.index_files == first.index_files
    assert second.tensor_bytes_by_class() == first.tensor_bytes_by_class()
    assert len(second.tensors) == len(first.tensors)
    # the tensors themselves, when asked for, are read again, with their offsets
    assert tuple(second.tensors) == first_tensors
    assert calls == list(first.index_files)
    assert all(t.offset_bytes > 0 for t in first_tensors)


def test_a_changed_file_is_read_again(aged_model, cache, monkeypatch):
    read_model_facts(aged_model)
    shard = sorted(aged_model.glob("*.safetensors"))[0]
    old = shard.stat().st_mtime - 30  # same size, another mtime: a re-download
    os.utime(shard, (old, old))
    calls = count_header_reads(monkeypatch)
    read_model_facts(aged_model)
    assert shard.name in calls


def test_a_shard_rewritten_in_place_under_its_old_mtime_is_read_again(aged_model, cache):
    """Issue 39 class 5: same size, same mtime (put back with os.utime, as `cp -p` and
    `touch -d` do), other bytes: the cache must not vouch for it."""
    read_model_facts(aged_model)
    shard = sorted(aged_model.glob("*.safetensors"))[0]
    st = shard.stat()
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("[")  # the header's opening brace: the JSON is now no object
    with open(shard, "r+b") as fh:  # in place: the same inode, the same size
        fh.write(raw)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(model_module.ModelFactsError, match="header is not JSON"):
        read_model_facts(aged_model)


def test_a_damaged_shard_after_caching_is_refused(aged_model, cache):
    read_model_facts(aged_model)
    shard = sorted(aged_model.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # size changes: not the cached file
    with pytest.raises(model_module.ModelFactsError, match="truncated"):
        read_model_facts(aged_model)


def test_files_written_just_now_are_not_cached(tmp_path, cache):
    # Within the filesystem's timestamp granularity a rewrite may keep size and mtime.
    path = tmp_path / "fresh"
    write_skeleton(path, "tiny", fixed_metadata=True)
    read_model_facts(path)
    assert not cache.exists() or list(cache.glob("*.json")) == []


def test_an_unreadable_cache_entry_is_ignored(aged_model, cache, monkeypatch):
    first = read_model_facts(aged_model)
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    calls = count_header_reads(monkeypatch)
    again = read_model_facts(aged_model)
    assert calls and again.tensor_bytes_by_class() == first.tensor_bytes_by_class()
    assert json.loads(entry.read_text())["version"] == header_cache.CACHE_VERSION  # rewritten


def test_planning_by_class_equals_planning_tensor_by_tensor(full_model):
    ranges = [(0, 16), (16, 32), (32, 48)]
    ple = frozenset(ple_shard_names(full_model.text_config))
    rank_of = {i: r for r, (a, b) in enumerate(ranges) for i in range(a, b)}
    per_rank, dense, routed = [0, 0, 0], 0, 0
    for t in full_model.tensors:  # the placement of every one of the 225,300 tensors
        spot = place_tensor(t.name, ple)
        if spot.where in ("disk", "unused"):
            continue
        rank = {"layer": rank_of.get(spot.layer), "first": 0, "last": 2}[spot.where]
        per_rank[rank] += t.nbytes
        if spot.routed_expert:
            routed += t.nbytes
        elif not spot.embedding:
            dense += t.nbytes
    assert weights_per_rank(full_model, ranges) == (per_rank, dense, routed)
    assert len(full_model.tensor_bytes_by_class()) < len(full_model.tensors) / 50


def test_tensor_class_folds_only_the_expert_number():
    name = "model.language_model.layers.7.mlp.experts.311.down_proj.weight_packed"
    assert (
        tensor_class(name) == "model.language_model.layers.7.mlp.experts.*.down_proj.weight_packed"
    )
    ple = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_17.weight"
    assert tensor_class(ple) == ple
    assert bytes_by_class([name, name.replace(".311.", ".0."), ple], [1, 2, 4]) == {
        tensor_class(name): 3, ple: 4
    }  # fmt: skip


def test_lazy_tensors_know_their_count_without_loading():
    loads = []
    lazy = LazyTensors(2, lambda: loads.append(1) or ["a", "b"])
    assert len(lazy) == 2 and loads == []
    assert list(lazy) == ["a", "b"] and lazy[1] == "b" and loads == [1]


# ---------------------------------------------------------------- two processes


def write_shards(root, layout, index):
    """`layout`: file → tensor names (F32 [2] each); `index`: name → file (the weight_map)."""
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen4_exp"}')
    for file, names in layout.items():
        header = {n: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]}
                  for i, n in enumerate(names)}  # fmt: skip
        raw = json.dumps(header).encode()
        (root / file).write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8 * len(names)))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


def shard_layout(n=10):
    files = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return {f: [f"layers.{i}.a.weight", f"layers.{i}.b.weight"] for i, f in enumerate(files)}


def index_of(layout):
    return {n: f for f, names in layout.items() for n in names}


@pytest.fixture
def forked(monkeypatch):
    """Record that the read went through the forked child."""
    seen = []
    real = model_module._can_fork
    monkeypatch.setattr(model_module, "_can_fork", lambda n: seen.append(real(n)) or seen[-1])
    return seen


def test_many_shards_are_read_by_two_processes_alike(tmp_path, cache, forked):
    layout = shard_layout()
    write_shards(tmp_path / "m", layout, index_of(layout))
    facts = read_model_facts(tmp_path / "m")
    if forked != [True]:
        pytest.skip("one CPU here: the read ran in one process")
    assert [s.file for s in facts.shards] == list(layout)
    assert [t.name for t in facts.tensors] == [n for names in layout.values() for n in names]


@pytest.mark.parametrize(
    "damage, words",
    [
        ("wrong_file", "is mapped to model-00002-of-00010.safetensors but stored in"),
        ("twice", "is also in model-00001-of-00010.safetensors"),
        ("unindexed", "1 tensor(s) stored in shards but missing from weight_map"),
        ("not_stored", "is mapped to model-00004-of-00010.safetensors but no shard holds it"),
    ],
)
def test_index_problems_are_named_whichever_process_read_the_shard(tmp_path, cache, damage,
                                                                   words):  # fmt: skip
    layout = shard_layout()
    files = list(layout)
    index = index_of(layout)
    if damage == "wrong_file":  # shard 9 (the child's half) holds what the index puts in 2
        index[layout[files[8]][0]] = files[1]
    elif damage == "twice":  # a name of shard 1 stored again in shard 6
        layout[files[5]].append(layout[files[0]][0])
    elif damage == "unindexed":
        del index[layout[files[7]][1]]
    else:
        index["layers.99.c.weight"] = files[3]
    write_shards(tmp_path / "m", layout, index)
    with pytest.raises(model_module.ModelFactsError) as err:
        read_model_facts(tmp_path / "m")
    assert words in str(err.value)
