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

  # Provided by the NVIDIA driver at run time (/run/opengl-driver/lib on NixOS,
  # the CDI mounts in a container), never by the store.
  autoPatchelfIgnoreMissingDeps = [
    "libcuda.so.1"
    "libnvidia-ml.so.1"
  ];

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
