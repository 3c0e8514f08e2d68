# Filtered sources. Each derivation sees only the files it uses, so an edit
# elsewhere (a README, a launcher module, a test) does not rebuild the heavy
# parts: the wheelhouse depends on the lock only, the vLLM env on pins/ and
# patches/ only, the launcher on launcher/ only.
{ lib }:
let
  fs = lib.fileset;
  root = ../.;
  source = files: fs.toSource {
    inherit root;
    fileset = fs.unions files;
  };
in
{
  # Changes here do not refetch: a fixed-output path depends on its name
  # (which carries the lock's hash) and its output hash only.
  wheelhouse = source [
    ../pins
    ../nix/build-vllm-env.py
  ];

  vllmEnv = source [
    ../pins
    ../patches
    ../nix/build-vllm-env.py
  ];

  launcher = source [ ../launcher ];

  # The documented image contract (containers/README.md) and its checker.
  imageContract = source [
    ../containers/README.md
    ../nix/check-image-config.py
  ];

  # Suites that run inside the build sandbox (see nix/checks.nix).
  launcherChecks = source [
    ../launcher
    ../checks/launcher
    ../checks/fixtures
    # The stand-in's faults under load (checks/launcher/test_serve_faults.py).
    ../checks/faults
    # The bootstrap's venv cache (checks/launcher/test_launcher_venv_cache.py).
    ../checks/lib.sh
    # `flashnext report` lists the checkout's patch series.
    ../patches
    # checks/launcher runs checks/gpu/serve/serve-tiny with a stand-in vllm and
    # writes checks/gpu/tiny/tiny_model.py's checkpoint.
    ../checks/gpu
    # The README's first-start steps, the root bootstrap as invoked, and the
    # env builder the vllm.env fix names (checks/launcher/test_readme_first_start.py,
    # test_cli.py, test_vllm_env.py).
    ../README.md
    ../flashnext
    ../pins
    # The README's test command is the CI's (test_readme_commands.py), and the
    # image's service account is read from its Containerfile (test_report.py).
    ../.ci/run
    ../containers/Containerfile
  ];
  pinsChecks = source [
    ../pins
    ../patches
    ../checks/pins
    # checks/pins/test_nix_env_steps.py runs the env's install and smoke steps.
    ../nix/build-vllm-env.py
  ];
  patchChecks = source [
    ../patches
    ../checks/patches
    ../checks/fixtures
    # test_qsa_block_size compares the patch with the launcher's sizing.
    ../launcher
  ];
}
