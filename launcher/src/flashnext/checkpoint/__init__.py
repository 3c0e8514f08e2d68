"""What changes the checkpoint: `checkpoint fix` (fix.py: the quantization targets from
the tensors, targets.py; the sampling keys from the user, sampling.py) and `checkpoint
mtp-int4` (mtp_int4.py). What reads it is in facts/ (stored_schemes.py, scheme_map.py);
`checkpoint check` is a check (checks/checkpoint_metadata.py)."""
