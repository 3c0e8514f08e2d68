#!/usr/bin/env python3
"""checks/run's closing report over the pytest junit files of one run.

    summarize.py RESULTS_DIR FAILED_SUITES

Prints, in this order: the expected failures (strict xfails: a patch proof that
must fail on stock vLLM is working as intended, not skipped), the skips grouped
by reason, where the junit files are, and last the one line CI parses:

    checks: N passed, N failed, N skipped

(its format never changes: xfails are reported on their own line above it and
counted in none of the three). FAILED_SUITES is how many suites exited non-zero;
a suite that failed outside pytest (an install, a lint) counts as one failure.
Standard library only.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REASON_WIDTH = 110


@dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    # reason -> suite -> count
    skip_reasons: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    xfail_reasons: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))


def suite_of(path: Path) -> str:
    """`pins-2.xml` -> `pins`, `patches-2-stock.xml` -> `patches/stock` (a suite may
    write several files: a run number, then what the run was)."""
    match = re.fullmatch(r"(?P<suite>.+?)-\d+(?:-(?P<what>.+))?", path.stem)
    if not match:
        return path.stem
    return "/".join(filter(None, (match["suite"], match["what"])))


def reason_of(element: ET.Element) -> str:
    reason = (element.get("message") or "").strip() or "(no reason given)"
    for prefix in ("Skipped: ", "reason: "):
        reason = reason.removeprefix(prefix)
    return " ".join(reason.split())


def tally(results: Path) -> tuple[Tally, list[Path]]:
    out = Tally()
    files = sorted(results.glob("*.xml"))
    for path in files:
        suite = suite_of(path)
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                out.failed += 1
                continue
            skipped = case.find("skipped")
            if skipped is None:
                out.passed += 1
            elif skipped.get("type") == "pytest.xfail":
                out.xfailed += 1
                out.xfail_reasons[reason_of(skipped)][suite] += 1
            else:
                out.skipped += 1
                out.skip_reasons[reason_of(skipped)][suite] += 1
    return out, files


def grouped(reasons: dict[str, Counter]) -> list[str]:
    rows = sorted(reasons.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    lines = []
    for reason, suites in rows:
        where = ", ".join(f"{s} {n}" for s, n in sorted(suites.items()))
        text = reason if len(reason) <= REASON_WIDTH else reason[: REASON_WIDTH - 3] + "..."
        lines.append(f"  {sum(suites.values()):>4}  {text}  [{where}]")
    return lines


def report(results: Path, failed_suites: int) -> list[str]:
    t, files = tally(results)
    lines = []
    if t.xfailed:
        lines.append(
            f"checks: {t.xfailed} xfailed (expected failures, strict: each must fail, "
            "e.g. a patch proof on stock vLLM; one that passes counts as failed)"
        )
        lines += grouped(t.xfail_reasons)
    if t.skipped:
        lines.append(f"checks: {t.skipped} skipped, by reason:")
        lines += grouped(t.skip_reasons)
    if files:
        names = ", ".join(p.name for p in files)
        lines.append(f"checks: junit files in {results}: {names}")
    else:
        lines.append(f"checks: no junit files in {results}")
    failed = max(t.failed, failed_suites)
    lines.append(f"checks: {t.passed} passed, {failed} failed, {t.skipped} skipped")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: summarize.py RESULTS_DIR FAILED_SUITES", file=sys.stderr)
        return 2
    print("\n".join(report(Path(argv[0]), int(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
