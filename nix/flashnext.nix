# The launcher, run by the vLLM env's own Python: click, rich, nvidia-ml-py,
# psutil, httpx and pydantic come from the same hash-locked closure, and `vllm` is on PATH for `serve`.
# It is installed into its own small prefix rather than into the env, so a
# launcher edit rebuilds kilobytes, not the 9 GB environment.
{
  lib,
  stdenv,
  makeWrapper,
  vllm-env,
  src,
  version,
}:
let
  envPython = "${vllm-env}/venv/bin/python";
  # Where the NVIDIA driver's libraries are on NixOS; elsewhere the user's
  # LD_LIBRARY_PATH (kept, searched first) or the image's settings provide them.
  driverLib = "/run/opengl-driver/lib";
in
stdenv.mkDerivation {
  pname = "flashnext";
  inherit version src;

  nativeBuildInputs = [ makeWrapper ];
  # Nothing to compile; the C compiler is for Triton, which builds its kernel
  # launchers at run time (hence stdenv.cc on the wrapper's PATH).
  dontPatchELF = true;

  dontConfigure = true;
  # setuptools is in the locked closure; no index, no build isolation: offline.
  buildPhase = ''
    runHook preBuild
    export HOME="$TMPDIR"
    ${envPython} -m pip install --no-index --no-deps --no-build-isolation \
      --no-compile --prefix "$out" ./launcher
    runHook postBuild
  '';
  dontInstall = true;

  postFixup = ''
    wrapProgram "$out/bin/flashnext" \
      --prefix PYTHONPATH : "$out/${vllm-env.pythonSitePackages}" \
      --prefix PATH : "${vllm-env}/venv/bin" \
      --suffix PATH : "${lib.makeBinPath [ stdenv.cc ]}" \
      --suffix LD_LIBRARY_PATH : "${driverLib}" \
      --run ". ${./find-libcuda.sh}"
  '';

  passthru = {
    inherit vllm-env;
    inherit driverLib;
  };

  meta = {
    description = "Serve Qwen3.8-Flash-Next on 3x RTX 3090 with a patched vLLM (PP=3)";
    mainProgram = "flashnext";
    platforms = [ "x86_64-linux" ];
  };
}
