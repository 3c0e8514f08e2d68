"""containers/debian_base.py shows debootstrap's progress (issue 43: 1.5 silent minutes).

Stage lines pass through, per-package lines become a count every PROGRESS_EVERY
seconds, and a failure's message keeps the last lines. The lines are debootstrap's
own format (bookworm minbase); a clock stands in for the minutes.
"""

from __future__ import annotations

import io
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "containers"))
from debian_base import follow  # noqa: E402

DEBOOTSTRAP = """I: Retrieving InRelease
I: Checking Release signature
I: Valid Release signature (key id 4CB50190207B4758A3F73A796ED0E7B82643E131)
I: Retrieving Packages
I: Validating Packages
I: Resolving dependencies of required packages...
I: Checking component main on http://mirror/debian...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving apt 2.6.1
I: Validating apt 2.6.1
I: Retrieving base-files 12.4+deb12u11
I: Validating base-files 12.4+deb12u11
I: Chosen extractor for .deb packages: dpkg-deb
I: Extracting adduser...
I: Extracting apt...
I: Installing core packages...
I: Unpacking required packages...
I: Unpacking adduser...
I: Configuring required packages...
I: Configuring adduser...
I: Base system installed successfully.
"""


def test_stages_pass_through_and_packages_are_counted():
    out = io.StringIO()
    ticks = itertools.count(0, 10)  # every line 10 s later
    last = follow(io.StringIO(DEBOOTSTRAP), out, every=15, clock=lambda: next(ticks))
    shown = out.getvalue().splitlines()
    assert "debian_base: debootstrap: I: Installing core packages..." in shown
    assert shown[-1] == "debian_base: debootstrap: I: Base system installed successfully."
    counts = [ln for ln in shown if " package " in ln]
    # one clock read per package line, 10 s apart: a count at most every 15 s
    assert counts == [
        "debian_base: debootstrap: validating package 1, 20 s",
        "debian_base: debootstrap: validating package 2, 40 s",
        "debian_base: debootstrap: validating package 3, 60 s",
        "debian_base: debootstrap: extracting package 2, 80 s",
        "debian_base: debootstrap: configuring package 1, 100 s",
    ]
    assert not any("adduser 3.134" in ln for ln in shown)  # per-package lines are counted
    # each run of package lines ends with its totals, before the next stage line
    at = shown.index("debian_base: debootstrap: I: Chosen extractor for .deb packages: dpkg-deb")
    assert shown[at - 1] == "debian_base: debootstrap: retrieving 3, validating 3 packages"
    at = shown.index("debian_base: debootstrap: I: Installing core packages...")
    assert shown[at - 1] == "debian_base: debootstrap: extracting 2 packages"
    assert last[-1] == "I: Base system installed successfully." and len(last) == 10


def test_a_quiet_clock_prints_no_counts_only_totals():
    out = io.StringIO()
    follow(io.StringIO(DEBOOTSTRAP), out, every=15, clock=lambda: 0)
    assert not [ln for ln in out.getvalue().splitlines() if " package " in ln]
    assert out.getvalue().count(" packages\n") == 4  # the 4 runs of package lines
