# The locked wheel closure of vLLM 0.33.0 for CPython 3.12, as a fixed-output
# derivation: the only build step with network access, so its output is pinned
# by hash. pip checks every wheel against the lock's --hash lines; the NAR hash
# pins the directory as a whole.
#
# The hash cannot be computed on the machines this repository is developed on
# (no nixpkgs there). Until nix/update-wheelhouse-hash has been run on a Nix
# machine, nix/wheelhouse-hash.json holds null and the build fails closed with
# Nix's "hash mismatch ... got: sha256-..." (lib.fakeHash never matches).
{
  lib,
  stdenvNoCC,
  cacert,
  python,
  pins,
  src,
}:
let
  record = pins.wheelhouseHash;
in
# A lock edited without refreshing the hash must not silently reuse an old
# wheelhouse: fail at evaluation with the fix.
assert lib.assertMsg (record.lock_sha256 == pins.lockSha256) ''
  pins/requirements-cp312.txt changed (sha256 ${pins.lockSha256}) but
  nix/wheelhouse-hash.json was computed for ${record.lock_sha256}.
  Run nix/update-wheelhouse-hash on a machine with Nix and network access.'';
stdenvNoCC.mkDerivation {
  # The lock's hash is in the name: a new lock is a new store path, never a
  # stale wheelhouse that happens to carry the old output hash.
  name = "flashnext-wheelhouse-cp312-${builtins.substring 0 16 pins.lockSha256}";
  inherit src;

  # pins/pinkit runs `sys.executable -m pip download`: a Python with pip.
  nativeBuildInputs = [ (python.withPackages (ps: [ ps.pip ])) ];

  dontConfigure = true;
  buildPhase = ''
    runHook preBuild
    export HOME="$TMPDIR" SSL_CERT_FILE=${cacert}/etc/ssl/certs/ca-bundle.crt
    # pins/build-env's own download step (pip download --require-hashes, then
    # every file hashed against the lock); $out holds only the wheels.
    python3 nix/build-vllm-env.py wheelhouse "$out"
    runHook postBuild
  '';
  dontInstall = true;
  dontFixup = true;

  outputHashMode = "recursive";
  outputHashAlgo = "sha256";
  outputHash = if record.output_hash == null then lib.fakeHash else record.output_hash;

  passthru = {
    inherit (pins) lockSha256;
    hashComputed = record.output_hash != null;
  };
}
