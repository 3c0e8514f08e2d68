"""Issue 25, class 11: `checkpoint fix` and `skeleton` on a read-only or full disk say
which directory, what happened and the fix, never a raw errno with a hidden temp name;
for a read-only checkpoint, `serve --generation-config DIR`. Real tmpfs mounts (chmod
does not stop root); skipped where mounting is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def mount(tmp_path):
    mounted = []

    def make(path: Path, options: str) -> Path:
        path.mkdir(exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_fix_on_a_read_only_checkpoint_offers_serve_generation_config(mount, tmp_path):
    model = mount(tmp_path / "ro", "size=64m") / "m"
    write_skeleton(model, "tiny")  # the shipped defects
    subprocess.run(["mount", "-o", "remount,ro", str(model.parent)], check=True)
    result = invoke("checkpoint", "fix", "--model", model, "--sampling", "temperature=0.7")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: cannot write in {model}: it is on a read-only filesystem\n"
        "  fix: copy the checkpoint to a writable directory and run `flashnext checkpoint fix` "
        "there, or make this one writable\n"
    )


def test_fix_of_only_sampling_on_a_read_only_checkpoint(mount, tmp_path):
    model = mount(tmp_path / "ro", "size=64m") / "m"
    write_skeleton(model, "tiny")
    assert invoke("checkpoint", "fix", "--model", model, "--sampling", "top_p=0.8").exit_code == 0
    (model / "generation_config.json").write_text("{}")  # only the sampling keys to restore
    subprocess.run(["mount", "-o", "remount,ro", str(model.parent)], check=True)
    result = invoke("checkpoint", "fix", "--model", model, "--sampling", "temperature=0.7")
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        "  fix: leave the checkpoint as it is: serve with `flashnext serve --generation-config "
        "DIR`, DIR holding the published generation_config.json"
    )


def test_skeleton_on_a_full_disk(mount, tmp_path):
    full = mount(tmp_path / "full", "size=64k")
    out = full / "skel"
    result = invoke("skeleton", out, "--tiny")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: cannot write in {out}: no space left on the device\n"
        f"  fix: free space on {out}, then rerun\n"
    )
    assert "/." not in result.output  # no hidden temp name
