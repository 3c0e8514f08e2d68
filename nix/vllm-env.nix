# The patched vLLM 0.33.0 environment: a venv installed offline from the
# wheelhouse, the patch series applied with patches/apply, import-smoked. The
# steps are pins/build-env's, the same script CI runs outside Nix; this file
# only adds what the Nix store needs (ELF patching, the driver runpath).
#
# Output layout = pins/build-env's ENV: venv/ (patched) and stock/ (the
# pristine vllm tree, for the patch proofs).
{
  stdenv,
  python,
  pins,
  wheelhouse,
  src,
  autoPatchelfHook,
  autoAddDriverRunpath,
  gnupatch,
  zlib,
}:
stdenv.mkDerivation {
  pname = "flashnext-vllm-env";
  version = pins.vllmVersion;
  inherit src;

  nativeBuildInputs = [
    python
    gnupatch
    autoPatchelfHook
    # Adds /run/opengl-driver/lib to every ELF's runpath after autoPatchelf:
    # dlopen()ed driver libraries (libcuda) are found on NixOS.
    autoAddDriverRunpath
  ];
  # What the manylinux wheels link against besides each other.
  buildInputs = [
    stdenv.cc.cc.lib
    zlib
  ];

  # DT_NEEDED entries nothing in the store provides, as nix/elf-deps.py lists
  # them for the locked wheels (checks/nix keeps this list complete). Each is
  # either the driver's or belongs to an optional plugin vLLM never loads.
  autoPatchelfIgnoreMissingDeps = [
    # The NVIDIA driver, at run time: /run/opengl-driver/lib on NixOS, the
    # CDI mounts in a container.
    "libcuda.so.1"
    # torchcodec (video decoding; text-only serving never loads it): one core
    # library per FFmpeg major version, whichever dlopen() finds wins.
    "libavcodec.so.*"
    "libavdevice.so.*"
    "libavfilter.so.*"
    "libavformat.so.*"
    "libavutil.so.*"
    "libswresample.so.*"
    "libswscale.so.*"
    "libheif.so.1"
    # NVSHMEM and cuFile transports for multi-node / RDMA fabrics, dlopen()ed
    # plugins; a single host with PCIe P2P uses none of them.
    "libfabric.so.1"
    "libibverbs.so.1"
    "librdmacm.so.1"
    "libmlx5.so.1"
    "libmpi.so.40"
    "liboshmem.so.40"
    "libpmix.so.2"
    "libucp.so.0"
    "libucs.so.0"
    # numba's optional TBB and OpenMP threading layers (the default is its own).
    "libtbb.so.12"
    "libgomp.so.1.0.0"
  ];

  # patches/apply and pins/ scripts are run directly (#!/usr/bin/env python3);
  # the sandbox has no /usr/bin/env.
  postPatch = ''
    patchShebangs pins patches nix
  '';
  dontConfigure = true;
  # pins/build-env's steps (nix/build-vllm-env.py): venv, offline
  # --require-hashes install from the wheelhouse, stock copy, patches/apply.
  buildPhase = ''
    runHook preBuild
    export HOME="$TMPDIR"
    ${python.interpreter} nix/build-vllm-env.py install "$out" ${wheelhouse}
    runHook postBuild
  '';
  dontInstall = true;

  # The import smoke runs on the output as it will be used: after
  # autoPatchelf has pointed the wheels' libraries at the store.
  doInstallCheck = true;
  installCheckPhase = ''
    runHook preInstallCheck
    ${python.interpreter} nix/build-vllm-env.py smoke "$out"
    runHook postInstallCheck
  '';

  # Stripping the CUDA libraries saves little and has broken them before.
  dontStrip = true;
  # ENV/venv/bin/python runs the patched vLLM; "lib/python3.12/site-packages".
  passthru.pythonSitePackages = python.sitePackages;

  meta = {
    description = "vLLM ${pins.vllmVersion} with the flashnext patch series";
    platforms = [ "x86_64-linux" ];
  };
}
