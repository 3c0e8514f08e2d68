"""read_model_facts: configs and safetensors headers, strict like the `safetensors` library.

Every corrupt-file case is also opened with the `safetensors` library (a test
dependency of the launcher venv): a file we refuse must be one it refuses too,
and a file it writes must be one we read, so our reader is neither looser nor
stricter than what vLLM loads with.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from flashnext.facts.model import (
    INDEX_FILE,
    ModelFactsError,
    read_model_facts,
    read_safetensors_header,
)
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    ple_head_vocab_sizes,
    ple_shard_names,
    ple_shard_rows,
    ple_table_shape,
    sampling_keys_present,
)
from flashnext.skeleton import full_text_config, tiny_text_config, write_skeleton
from safetensors import safe_open
from safetensors.numpy import save_file

# ---------------------------------------------------------------- helpers


def write_raw(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def good_file(path: Path) -> Path:
    """Two tensors written by the safetensors library itself."""
    save_file(
        {
            "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b.weight_shape": np.array([3, 4], dtype=np.int64),
        },
        str(path),
        metadata={"format": "pt"},
    )
    return path


def library_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                f.get_slice(key).get_shape()
    except Exception:
        return True
    return False


@pytest.fixture()
def tiny_dir(tmp_path):
    path = tmp_path / "tiny"
    write_skeleton(path, "tiny")
    return path


# ---------------------------------------------------------------- good input


def test_reads_what_the_safetensors_library_writes(tmp_path):
    path = good_file(tmp_path / "model.safetensors")
    size, header_len, tensors = read_safetensors_header(path)
    assert size == path.stat().st_size
    by_name = {t.name: t for t in tensors}
    assert by_name["a.weight"].dtype == "F32" and by_name["a.weight"].shape == (3, 4)
    assert by_name["a.weight"].nbytes == 48
    assert by_name["b.weight_shape"].dtype == "I64" and by_name["b.weight_shape"].nbytes == 16
    assert 8 + header_len + 48 + 16 == size


def test_names_that_look_like_json_literals_are_fine(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {
        f"{word}.{i}.weight": np.zeros((2, 3), dtype=np.float16)
        for i in range(3)
        for word in ("true", "null", "1.5e3")
    }
    save_file(tensors, str(path))
    _, _, infos = read_safetensors_header(path)
    assert {(t.name, t.shape, t.dtype) for t in infos} == {(n, (2, 3), "F16") for n in tensors}


def test_single_file_model_without_index(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    good_file(root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "x"}))
    facts = read_model_facts(root)
    assert facts.index_files == ("model.safetensors",)
    assert facts.generation_config is None
    assert facts.quantization_config is None
    assert {t.name for t in facts.tensors} == {"a.weight", "b.weight_shape"}


def test_tiny_checkpoint_facts(tiny_dir):
    facts = read_model_facts(tiny_dir)
    index = json.loads((tiny_dir / INDEX_FILE).read_text())
    assert facts.model_type == "qwen4_exp"
    assert facts.architectures == ("Qwen4ExpForConditionalGeneration",)
    assert facts.text_config["model_type"] == "qwen4_exp_text"
    assert facts.quantization_config["quant_method"] == "compressed-tensors"
    assert len(facts.quantization_config["config_groups"]) == 4
    assert facts.generation_config is not None
    assert {t.name: t.file for t in facts.tensors} == index["weight_map"]
    assert sum(t.nbytes for t in facts.tensors) == index["metadata"]["total_size"]
    assert len(facts.shards) == len(set(index["weight_map"].values())) > 1
    for shard in facts.shards:
        assert shard.file_size_bytes == (tiny_dir / shard.file).stat().st_size
        assert shard.tensor_count == sum(t.file == shard.file for t in facts.tensors)


# ---------------------------------------------------------------- corrupt shards

BAD_SHARDS = {
    # name: (how to corrupt a good file, part of our error message)
    "shorter_than_length_prefix": (lambda p: p.write_bytes(b"\x10\x00\x00"), "too short"),
    "absurd_header_length": (
        lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"),
        "not a plausible safetensors header",
    ),
    "header_cut_short": (
        lambda p: p.write_bytes(p.read_bytes()[:20]),
        "truncated: header says",
    ),
    "data_cut_short": (
        lambda p: p.write_bytes(p.read_bytes()[:-10]),
        "the file is truncated",
    ),
    "corrupt_json": (
        lambda p: p.write_bytes(struct.pack("<Q", 9) + b'{"a": [1,'),
        "not valid JSON",
    ),
    "json_not_an_object": (lambda p: write_raw(p, [1, 2], b""), "not an object"),
    "offsets_past_the_end": (
        lambda p: write_raw(
            p, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}, bytes(16)
        ),
        "ends at byte 32",
    ),
    "offsets_disagree_with_shape": (
        lambda p: write_raw(
            p, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)
        ),
        "span 8",
    ),
    "overlapping_tensors": (
        lambda p: write_raw(
            p,
            {
                "t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "u": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            bytes(24),
        ),
        "overlaps the previous tensor",
    ),
    "hole_between_tensors": (
        lambda p: write_raw(
            p,
            {
                "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "u": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
            },
            bytes(24),
        ),
        "8 unused bytes before tensor 'u'",
    ),
    "trailing_bytes": (
        lambda p: write_raw(
            p, {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12)
        ),
        "trailing bytes",
    ),
    "unknown_dtype": (
        lambda p: write_raw(
            p, {"t": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)
        ),
        "unknown dtype 'F33'",
    ),
    "negative_dim": (
        lambda p: write_raw(p, {"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}, b""),
        "invalid shape",
    ),
    # Floats and bools are rejected even when an identical valid (dtype, shape)
    # was seen first (the reader's fast path caches validated shapes).
    "float_dim_after_a_valid_twin": (
        lambda p: write_raw(
            p,
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2.0], "data_offsets": [8, 16]},
            },
            bytes(16),
        ),
        "invalid shape [2.0]",
    ),
    "bool_dim": (
        lambda p: write_raw(
            p, {"t": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, bytes(8)
        ),
        "invalid shape [True, 2]",
    ),
    "float_offset": (
        lambda p: write_raw(
            p, {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, bytes(8)
        ),
        "invalid data_offsets [0, 8.0]",
    ),
    "missing_offsets": (
        lambda p: write_raw(p, {"t": {"dtype": "F32", "shape": [2]}}, bytes(8)),
        "invalid data_offsets",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SHARDS))
def test_corrupt_shard_is_refused_like_the_library_does(tmp_path, case):
    corrupt, message = BAD_SHARDS[case]
    path = good_file(tmp_path / "model.safetensors")
    corrupt(path)
    with pytest.raises(ModelFactsError) as err:
        read_safetensors_header(path)
    text = str(err.value)
    assert text.startswith(f"{path}: "), text
    assert message in text, text
    assert "re-download this shard" in text  # the fix
    assert library_refuses(path), f"safetensors accepts {case}: our reader is too strict"


def test_corrupt_shard_inside_a_model_dir_names_the_file(tiny_dir):
    shard = sorted(tiny_dir.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFactsError, match=rf"^{shard}: .*truncated"):
        read_model_facts(tiny_dir)


# ---------------------------------------------------------------- incomplete directories


def test_missing_config(tiny_dir):
    (tiny_dir / "config.json").unlink()
    with pytest.raises(ModelFactsError) as err:
        read_model_facts(tiny_dir)
    assert str(err.value) == (
        f"{tiny_dir / 'config.json'}: missing model config; point --model at the checkpoint "
        "directory and make sure the download is complete"
    )


def test_missing_shard_named_by_the_index(tiny_dir):
    shard = sorted(tiny_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFactsError) as err:
        read_model_facts(tiny_dir)
    assert str(err.value) == (
        f"{shard}: missing shard named by model.safetensors.index.json; the download is "
        "incomplete: fetch the missing file(s) again"
    )


def test_no_weights_at_all(tiny_dir):
    for p in tiny_dir.glob("*.safetensors*"):
        p.unlink()
    with pytest.raises(ModelFactsError, match="neither model.safetensors.index.json nor"):
        read_model_facts(tiny_dir)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelFactsError, match="no such directory") as missing:
        read_model_facts(tmp_path / "nope")
    assert missing.value.missing_dir is True
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelFactsError, match="not a directory") as a_file:
        read_model_facts(tmp_path / "file")
    assert a_file.value.missing_dir is False


def test_index_and_shards_disagree(tiny_dir):
    index_path = tiny_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name + ".ghost"] = index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFactsError, match=r"\.ghost' is mapped to .* but no shard holds it"):
        read_model_facts(tiny_dir)

    del index["weight_map"][name + ".ghost"]
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFactsError, match="1 tensor\\(s\\) stored in shards but missing"):
        read_model_facts(tiny_dir)


def test_tensor_in_two_shards(tiny_dir):
    shards = sorted(tiny_dir.glob("model-*.safetensors"))
    shutil.copy(shards[0], tiny_dir / "copy.safetensors")
    index_path = tiny_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"]["zz.extra"] = "copy.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFactsError, match="is also in model-00001-of-"):
        read_model_facts(tiny_dir)


def test_bad_generation_config_is_an_error_not_ignored(tiny_dir):
    (tiny_dir / "generation_config.json").write_text("{oops")
    with pytest.raises(
        ModelFactsError,
        match=r"generation_config.json: not JSON \(.*\), so not a generation config",
    ):
        read_model_facts(tiny_dir)


# ---------------------------------------------------------------- derived values


def test_ple_table_shape_of_the_shipped_config():
    text = full_text_config()
    sizes = ple_head_vocab_sizes(text)
    # SPEC/maps/PLE.md: head sizes 20000003..20000171, total 320001446, padded to 128.
    assert len(sizes) == 16 and sizes[0] == 20_000_003 and sizes[-1] == 20_000_171
    assert sum(sizes) == 320_001_446
    assert ple_table_shape(text) == (320_001_536, 160)
    assert ple_shard_rows(text) == (2_500_012,) * 128
    assert 320_001_536 * 160 * 2 == 102_400_491_520  # the flat file's size
    names = ple_shard_names(text)
    assert len(names) == 128
    assert names[17] == (
        "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_17.weight"
    )


def test_ple_shards_with_an_uneven_split():
    text = tiny_text_config(split_ngram_parts=3)
    rows, cols = ple_table_shape(text)
    assert (rows, cols) == (4096, 32)  # primes 1009+1013+1019+1021 = 4062 -> 4096
    assert ple_shard_rows(text) == (1366, 1366, 1364)


def test_sampling_keys():
    assert "temperature" in VLLM_SAMPLING_KEYS and len(VLLM_SAMPLING_KEYS) == 9
    assert sampling_keys_present(None) == ()
    assert sampling_keys_present({"eos_token_id": 1, "do_sample": True}) == ()
    assert sampling_keys_present({"top_p": 0.8, "temperature": 0.7, "top_k": None}) == (
        "temperature",
        "top_p",
    )
