"""The PLE n-gram table: 128 checkpoint shards → one flat file on NVMe, and its checks.

- layout.py: where each shard's rows lie in the safetensors files (header offsets).
- prepare.py: stream the shards into one flat file, resumable, atomic.
- verify.py: size/shape, then random rows byte-compared with the shards.
- storage_policy.py: which output filesystems the table must not live on.

- file_layout.py: where row r lies in the flat file (packed or page-aligned) and
  the file's exact size; every size check goes through it.

The flat file is what the patched vLLM maps (patch 0010): no header, so a
manifest beside it (OUT.json) records shape, dtype and layout. Packed: row r
at r * row_bytes. Page-aligned: whole rows per 4 KiB page, then zero padding.
"""

from flashnext.table.errors import TableError

__all__ = ["TableError"]
