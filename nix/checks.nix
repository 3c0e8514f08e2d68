# `nix flake check`: the parts of checks/run that work inside the build
# sandbox (no network, no GPU), plus the image-config contract. The suites
# are the same pytest files CI runs; only the interpreter comes from here.
{
  pkgs,
  python,
  sources,
  vllm-env,
  flashnext,
  image,
}:
let
  # The launcher's dependencies and its `test` extra (launcher/pyproject.toml),
  # from nixpkgs; pip for the pins tests' tiny wheelhouse.
  testPython = python.withPackages (
    ps: with ps; [
      click
      rich
      nvidia-ml-py
      psutil
      httpx
      pydantic
      pytest
      safetensors
      numpy
      matplotlib
      pip
    ]
  );

  # pytest for the vLLM env's interpreter (same CPython 3.12 ABI).
  pytestPath = python.pkgs.makePythonPath [ python.pkgs.pytest ];

  suite =
    name: src: extra: script:
    pkgs.runCommand "flashnext-check-${name}" (
      {
        inherit src;
        # python3 on PATH so patchShebangs can point the scripts' shebangs at it.
        nativeBuildInputs = [
          pkgs.gnupatch
          testPython
        ];
      }
      // extra
    ) ''
      cp -r "$src" source && chmod -R u+w source && cd source
      patchShebangs .
      # HOME apart from TMPDIR: pytest's tmp dirs are under TMPDIR, and the
      # launcher shortens paths under HOME to ~ in its messages.
      export HOME="$TMPDIR/home" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
      mkdir -p "$HOME"
      ${script}
      touch "$out"
    '';
in
{
  # Run from the checkout as checks/run does (editable): the CLI tests call a
  # `flashnext` executable, `flashnext report` finds patches/ beside launcher/.
  # Deselected: the README test bootstraps ./flashnext's venv from the package
  # index, and the real-disk storage probe needs /sys, as do the h200-tiny
  # profile's two preflight tests (they judge the table's block device); the
  # sandbox has neither (checks/nix tests that all still exist).
  launcher = suite "launcher" sources.launcherChecks { } ''
    export PYTHONPATH="$PWD/launcher/src"
    mkdir -p "$TMPDIR/bin"
    printf '#!%s\nimport sys\nfrom flashnext.cli import main\nsys.exit(main())\n' \
      ${testPython}/bin/python > "$TMPDIR/bin/flashnext"
    chmod +x "$TMPDIR/bin/flashnext"
    export PATH="$TMPDIR/bin:$PATH"
    ${testPython}/bin/python -m pytest -q -p no:cacheprovider checks/launcher \
      --deselect checks/launcher/test_cli.py::test_readme_main_command_reports_honestly_on_this_machine \
      --deselect checks/launcher/test_probe_storage.py::test_real_work_disk_resolves \
      --deselect checks/launcher/test_profile_h200_tiny.py::test_preflight_passes_on_the_h200 \
      --deselect checks/launcher/test_profile_h200_tiny.py::test_the_3x3090_profile_still_refuses_that_disk
  '';

  # Lock-file consistency and the builder's cache/tamper tests (no download).
  # Deselected: `pins/lock --dry-run --python 3.12=/bin/true` builds its
  # resolver venv from the package index before it checks the interpreter.
  pins = suite "pins" sources.pinsChecks { } ''
    ${testPython}/bin/python -m pytest -q -p no:cacheprovider checks/pins \
      --deselect "checks/pins/test_check_cli.py::test_lock_refuses_bad_arguments_before_resolving[args1-pins/lock: error: /bin/true is not a working CPython]"
  '';

  # Patch proofs on CPU: every proof must fail on the stock tree (strict xfail)
  # and pass on the patched one; patches/apply's own tests run with them.
  patches = suite "patches" sources.patchChecks { } ''
    export PYTHONPATH=${pytestPath}
    PYTHONPATH=${vllm-env}/stock:$PYTHONPATH \
      ${vllm-env}/venv/bin/python -m pytest -q -p no:cacheprovider checks/patches --vllm-tree=stock
    ${vllm-env}/venv/bin/python -m pytest -q -p no:cacheprovider checks/patches --vllm-tree=patched
  '';

  # The image's entrypoint, env, ports and healthcheck are what
  # containers/README.md says. The config object dockerTools is given is
  # compared (building the 9 GB image is not needed); checks/containers
  # loads the same config into podman and compares what it reports.
  image-config =
    suite "image-config" sources.imageContract
      {
        imageConfig = builtins.unsafeDiscardStringContext (builtins.toJSON image.imageConfig);
        passAsFile = [ "imageConfig" ];
      }
      ''
        ${python.interpreter} nix/check-image-config.py \
          --readme containers/README.md --config "$imageConfigPath"
      '';

  # Building these is itself a test (the wheelhouse hash, the offline install,
  # patches/apply on the real tree, the import smoke in pins/build-env).
  inherit vllm-env flashnext;
}
