"""Run flashnext.serve.supervise in a process of its own, as `flashnext serve` does,
from a JSON config on argv[1], or on stdin when argv[1] is "-" (an env holding an API
key stays off the command line): {argv, env, executable?, options{...}}. Its log goes to
stderr; its exit code is supervise's."""

from __future__ import annotations

import json
import sys

from flashnext.serve import supervise


def main() -> int:
    cfg = json.loads(sys.stdin.read() if sys.argv[1] == "-" else sys.argv[1])
    return supervise(cfg["argv"], cfg["env"], executable=cfg.get("executable"),
                     log_stream=sys.stderr, **cfg["options"])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
