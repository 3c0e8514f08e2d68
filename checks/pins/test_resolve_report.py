"""Turning pip's installation report (format version 1) into pins and `# via`.

The report below follows the schema pip writes with `--report` (pip 23.x):
markers, extras and the per-file sha256 are what the code must read right.
"""

import pytest
from pinkit import checks, resolve

ENV_311 = {
    "implementation_name": "cpython",
    "implementation_version": "3.11.7",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "6.1.0",
    "platform_system": "Linux",
    "platform_version": "#1 SMP",
    "python_full_version": "3.11.7",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "sys_platform": "linux",
}


def _item(name, version, requires=(), sha="0" * 64, extras=None, filename=None):
    item = {
        "download_info": {
            "url": f"file:///wheels/{filename or f'{name}-{version}-py3-none-any.whl'}",
            "archive_info": {"hash": f"sha256={sha}", "hashes": {"sha256": sha}},
        },
        "is_direct": False,
        "requested": name == "vllm",
        "metadata": {
            "metadata_version": "2.1",
            "name": name,
            "version": version,
            "requires_dist": list(requires),
        },
    }
    if extras:
        item["requested_extras"] = extras
    return item


def _report(python_version="3.11", extra_items=()):
    env = dict(ENV_311, python_version=python_version, python_full_version=python_version + ".1")
    items = [
        _item(
            "vllm",
            "0.33.0",
            [
                "torch==2.14.0",
                'six>=1.16.0; python_version > "3.11"',
                "uvicorn[standard]",
                'pytest; extra == "test"',
            ],
            sha="1" * 64,
        ),
        _item("torch", "2.14.0", ['triton~=3.8.0; platform_system == "Linux"'], sha="2" * 64),
        _item("triton", "3.8.0", sha="3" * 64),
        _item("uvicorn", "0.54.0", ['uvloop>=0.15; extra == "standard"', "h11"], sha="4" * 64),
        _item("uvloop", "0.23.0", sha="5" * 64),
        _item("h11", "0.16.0", sha="6" * 64),
        *extra_items,
    ]
    if python_version == "3.12":
        items.append(_item("six", "1.17.0", sha="7" * 64))
    return {"version": "1", "pip_version": "23.2.1", "install": items, "environment": env}


def test_via_follows_markers_and_extras():
    report = resolve.parse_report(_report())
    pins, unreachable = resolve.to_pins(report, ["vllm"])
    by_name = {p.name: p for p in pins}
    assert unreachable == []
    assert by_name["uvloop"].via == ("uvicorn",)  # only through uvicorn[standard]
    assert by_name["uvicorn"].extras == ("standard",)
    assert by_name["torch"].extras == ()
    assert by_name["triton"].via == ("torch",)
    assert by_name["vllm"].via == ()
    assert by_name["torch"].sha256 == ("2" * 64,)
    assert "six" not in by_name and "pytest" not in by_name


def test_python_version_markers_are_read_from_the_reports_interpreter():
    report = resolve.parse_report(_report("3.12"))
    pins, _ = resolve.to_pins(report, ["vllm"])
    assert {p.name: p.via for p in pins}["six"] == ("vllm",)


def test_a_required_package_missing_from_the_report_is_an_error():
    raw = _report("3.12")
    raw["install"] = [i for i in raw["install"] if i["metadata"]["name"] != "six"]
    with pytest.raises(resolve.ResolveError, match="vllm requires 'six>=1.16.0.*' but six"):
        resolve.to_pins(resolve.parse_report(raw), ["vllm"])


def test_packages_nothing_requires_are_reported_unreachable():
    report = resolve.parse_report(_report(extra_items=[_item("stray", "1.0")]))
    _, unreachable = resolve.to_pins(report, ["vllm"])
    assert unreachable == ["stray"]


def test_a_file_without_published_sha256_is_refused():
    raw = _report()
    raw["install"][1]["download_info"]["archive_info"] = {}
    with pytest.raises(resolve.ResolveError, match="torch 2.14.0: the index published no sha256"):
        resolve.parse_report(raw)


def test_an_sdist_is_refused():
    raw = _report(extra_items=[_item("stray", "1.0", filename="stray-1.0.tar.gz")])
    with pytest.raises(resolve.ResolveError, match="non-wheel"):
        resolve.parse_report(raw)


def test_compare_finds_version_hash_and_via_drift():
    report = resolve.parse_report(_report())
    pins, _ = resolve.to_pins(report, ["vllm"])
    assert checks.compare(pins, report) == []
    by_name = {p.name: p for p in pins}
    drifted = [p for p in pins if p.name not in ("torch", "h11")]
    drifted.append(by_name["torch"].__class__("torch", "2.13.0", ("2" * 64,), ("vllm",)))
    drifted.append(by_name["h11"].__class__("h11", "0.16.0", ("f" * 64,), ("uvicorn",)))
    drifted.append(by_name["h11"].__class__("stray", "1.0", ("e" * 64,), ()))
    diffs = checks.compare(drifted, report)
    assert "torch: locked 2.13.0, resolved 2.14.0" in diffs
    assert any(d.startswith("h11: resolved file sha256 666") for d in diffs)
    assert "stray: pinned but not resolved" in diffs
    no_extra = [
        p if p.name != "uvicorn" else p.__class__(p.name, p.version, p.sha256, p.via) for p in pins
    ]
    assert checks.compare(no_extra, report) == [
        "uvicorn: extras [] in the lock, ['standard'] needed"
    ]


def test_target_platforms_cover_the_floor_and_legacy_aliases():
    from pinkit.target import Target

    platforms = Target("3.12", (2, 31)).platforms()
    assert platforms[0] == "manylinux_2_31_x86_64"
    assert platforms.index("manylinux2014_x86_64") == platforms.index("manylinux_2_17_x86_64") + 1
    assert platforms[-1] == "manylinux1_x86_64"
    assert "linux_x86_64" not in platforms
