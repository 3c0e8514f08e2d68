"""The PLE n-gram table: 128 checkpoint shards → one flat file on NVMe, and its checks.

- layout.py: where each shard's rows lie in the safetensors files (header offsets).
- prepare.py: stream the shards into one flat file, resumable, atomic.
- verify.py: size/shape, then random rows byte-compared with the shards.
- storage_policy.py: which output filesystems the table must not live on.

The flat file is what the patched vLLM maps (patch 0010): row r of the table is
at byte r * row_bytes; no header, so a manifest beside it records shape and dtype.
"""

from flashnext.table.errors import TableError

__all__ = ["TableError"]
