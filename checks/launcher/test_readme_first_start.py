"""Issue 13, finding 5: README's "First start" is a path a fresh clone can follow.

Every `./flashnext` line of its shell block is a command and options this CLI
accepts, `checkpoint fix` comes before preflight (the shipped export fails
preflight until it runs), the download names the profile's repository, and the
disk figures are the ones the code and pins/README.md give.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from click.testing import CliRunner
from flashnext.checkout import BUILD_CACHE_TEXT, BUILD_DOWNLOAD_TEXT, BUILD_INSTALLED_TEXT
from flashnext.cli import main
from flashnext.profiles import available_profiles
from flashnext.skeleton import reference_model_facts
from flashnext.table.file_layout import table_bytes

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## First start, step by step")
    return text[start : text.index("\n## ", start + 1)]


def shell_lines() -> list[list[str]]:
    block = re.search(r"```sh\n(.*?)```", section(), re.S).group(1)
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_every_flashnext_line_is_a_command_this_cli_accepts():
    lines = [w for w in shell_lines() if w[0] == "./flashnext"]
    assert len(lines) >= 7
    for words in lines:
        result = CliRunner().invoke(main, [*words[1:], "--help"])
        assert result.exit_code == 0, (words, result.output)


def test_the_steps_in_order():
    heads = [" ".join(w[:3]) for w in shell_lines()]
    assert heads[0] == "pins/build-env"
    order = [h for h in heads if h.startswith("./flashnext")]
    fix = order.index("./flashnext checkpoint fix")
    assert (
        order.index("./flashnext checkpoint check")
        < fix
        < order.index("./flashnext preflight --model")
    )
    assert order[-1] == "./flashnext serve --model"
    fix_line = next(w for w in shell_lines() if w[1:3] == ["checkpoint", "fix"])
    assert "--generation-config-from" in fix_line  # the sampling values' source, not invented
    assert "model the quantization was made" in section() and "model card" in section()


def test_the_download_names_the_profiles_repository():
    repo = available_profiles()["3x3090"].checkpoint.hub_repo
    download = next(w for w in shell_lines() if "download" in w)
    assert download[1:3] == ["download", repo] and download[-2] == "--local-dir"


def test_the_disk_budget_is_the_codes():
    text = " ".join(section().split())
    checkpoint = sum(t.nbytes for t in reference_model_facts("full").tensors)
    assert f"The checkpoint is {checkpoint / GIB:.2f} GiB" in text
    rows, row_bytes = 320_001_536, 320
    assert f"The PLE table is {table_bytes(rows, row_bytes, 'packed') / GIB:.2f} GiB" in text
    assert f"({table_bytes(rows, row_bytes, 'page-aligned') / GIB:.2f} GiB with" in text
    for figure in ("4 GB of wheels", "9.4 GB installed", "15 GB"):
        assert figure in text
    assert "4 GB of wheels" in BUILD_DOWNLOAD_TEXT and BUILD_INSTALLED_TEXT == "9.4 GB installed"
    assert "15 GB" in BUILD_CACHE_TEXT
