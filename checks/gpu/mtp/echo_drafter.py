#!/usr/bin/env python3
"""A copy of the tiny checkpoint whose MTP drafter echoes the target (issue 16).

    python checks/gpu/mtp/echo_drafter.py SRC_DIR DST_DIR --gain G

The MTP equality run needs a drafter that is right part of the time, so that
both accepted drafts and rejections (with the state rollback) really run.
A random MTP layer is almost never right (run mtp4: acceptance 0.014 on the
narrowed head), and training one needs the target's forward, which only runs
on a GPU. This copy instead sets three of the drafter's tensors so that it
repeats, at the next position, the token the target has just produced:

  mtp.pre_fc_norm_hidden.weight  0: GemmaRMSNorm scales by 1 + w, so the
                                 target's multi-stream state comes through
                                 only divided by its RMS
  mtp.fc_hidden.weight           G x identity: every stream passes, scaled by G
  mtp.hyper_connection_mixer.*   the target's final mixer (`...language_model.
                                 hyper_connection_mixer.*`)

Why that echoes: the target hands the drafter its pre-final-mixer
multi-stream state (model.py, `_mtp_hidden_buffer`). The drafter's MTP layer
only adds to each stream (`hc_combine`: residual + 2 sigmoid(inj) x block
output, for the embedding branch, attention and the experts alike), and the
final mixer RMS-normalizes each stream before it gates and averages them
(`hc_combine_norm`, `hc_gate_mix`). So where G x the state outweighs what the
layer adds, the drafter's mixer sees the target's streams up to a scale per
stream, and with the target's own mixer weights and the shared LM head it
yields the target's logits at that position: its draft is the token just
sampled. The target accepts it when it repeats that token.

G is the knob: the MTP layer's own random attention, experts and the
embedding branch still run and add about unit-RMS terms, so at small G they
win (the random drafter, rarely right) and at large G the echo does (right
whenever the target repeats itself, which on the narrowed head is ~95% of
positions, above the band). mtp_equality.py runs several gains side by side.
Nothing of the target changes: its output must be the same with any of them.
Only those tensors' bytes change (checkpoint_copy.py); a record
`echo_drafter.json` says which and with what gain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny"))

from checkpoint_copy import CheckpointEditError, Reader, edited_copy  # noqa: E402

RECORD = "echo_drafter.json"
NORM = "mtp.pre_fc_norm_hidden.weight"
FC_HIDDEN = "mtp.fc_hidden.weight"
MTP_MIXER = "mtp.hyper_connection_mixer."
MIXER_MARK = "hyper_connection_mixer.hc_norm.weight"


def target_mixer_prefix(reader: Reader) -> str:
    """Where the target's final mixer lives, e.g. model.language_model.hyper_connection_mixer."""
    found = [
        name.removesuffix("hc_norm.weight")
        for name in reader.weight_map
        if name.endswith(MIXER_MARK) and not name.startswith("mtp.")
    ]
    if len(found) != 1:
        raise CheckpointEditError(
            f"{reader.root}: expected one final mixer outside mtp.*, found {found or 'none'}"
        )
    return found[0]


def echo_edits(reader: Reader, gain: float) -> dict[str, np.ndarray]:
    for name in (NORM, FC_HIDDEN):
        if name not in reader:
            raise CheckpointEditError(
                f"{reader.root} has no {name}: not a checkpoint with an MTP layer"
            )
    fc = reader.read(FC_HIDDEN)
    if fc.ndim != 2 or fc.shape[0] != fc.shape[1]:
        raise CheckpointEditError(
            f"{FC_HIDDEN} is {list(fc.shape)}: a square projection was expected"
        )
    edits = {
        NORM: np.zeros_like(reader.read(NORM)),
        FC_HIDDEN: np.eye(fc.shape[0], dtype=np.float32) * np.float32(gain),
    }
    source = target_mixer_prefix(reader)
    for name in reader.weight_map:
        if name.startswith(MTP_MIXER):
            twin = source + name.removeprefix(MTP_MIXER)
            if twin not in reader:
                raise CheckpointEditError(f"{name} has no twin {twin} in the target's final mixer")
            edits[name] = reader.read(twin)
    if not any(name.startswith(MTP_MIXER) for name in edits):
        raise CheckpointEditError(f"{reader.root} has no {MTP_MIXER}* tensors")
    return edits


def write_echo_drafter(src: Path, dst: Path, gain: float) -> Path:
    if not gain > 0:
        raise CheckpointEditError(f"--gain {gain}: give a positive gain, e.g. 4")
    changed: list[str] = []

    def edit(reader: Reader) -> dict[str, np.ndarray]:
        edits = echo_edits(reader, gain)
        changed.extend(sorted(edits))
        return edits

    record = {"source": str(src), "gain": gain, "changed": changed}
    return edited_copy(src, dst, edit, RECORD, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("src_dir", type=Path)
    parser.add_argument("dst_dir", type=Path, help="new directory")
    parser.add_argument("--gain", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        path = write_echo_drafter(args.src_dir, args.dst_dir, args.gain)
    except (CheckpointEditError, OSError) as exc:
        print(f"echo_drafter: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: MTP drafter echoes the target at gain {args.gain:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
