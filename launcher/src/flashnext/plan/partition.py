"""Which decoder layers each pipeline-parallel rank owns, exactly as vLLM decides.

Mirrors `vllm.distributed.utils.get_pp_indices` of vLLM 0.33.0 (the launcher
never imports vLLM; a test compares this with the real function).
"""

from __future__ import annotations


class PartitionError(ValueError):
    """A VLLM_PP_LAYER_PARTITION that vLLM would refuse."""


def pp_layer_counts(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """Layers per rank. `partition` is VLLM_PP_LAYER_PARTITION ("16,16,16")."""
    if partition is not None:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError as exc:
            raise PartitionError(
                f"VLLM_PP_LAYER_PARTITION={partition!r} is not a comma-separated list of "
                f"integers; use e.g. {','.join(['16'] * pp_size)}"
            ) from exc
        if any(c < 1 for c in counts):
            raise PartitionError(
                f"VLLM_PP_LAYER_PARTITION={partition!r} gives a rank no layers; every count "
                f"must be at least 1, e.g. {','.join(['16'] * pp_size)}"
            )
        if len(counts) != pp_size:
            raise PartitionError(
                f"VLLM_PP_LAYER_PARTITION={partition!r} has {len(counts)} entries for "
                f"{pp_size} pipeline ranks; give one count per rank"
            )
        if sum(counts) != num_layers:
            raise PartitionError(
                f"VLLM_PP_LAYER_PARTITION={partition!r} sums to {sum(counts)}, the model "
                f"has {num_layers} layers"
            )
        return counts
    counts = [num_layers // pp_size] * pp_size
    # vLLM gives the remainder to the ranks before the last one, from the back:
    # the first rank holds the embedding, the last the LM head.
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def pp_layer_ranges(
    num_layers: int, pp_size: int, partition: str | None = None
) -> list[tuple[int, int]]:
    """[start, end) of the layers each rank owns."""
    ranges, start = [], 0
    for count in pp_layer_counts(num_layers, pp_size, partition):
        ranges.append((start, start + count))
        start += count
    return ranges


def rank_of_layer(layer: int, ranges: list[tuple[int, int]]) -> int:
    for rank, (start, end) in enumerate(ranges):
        if start <= layer < end:
            return rank
    raise IndexError(f"layer {layer} is outside every rank's range {ranges}")
