# The locked wheel closure of vLLM 0.33.0 for CPython 3.12, as a fixed-output
# derivation: the only build step with network access, so its output is pinned
# by hash. pip checks every wheel against the lock's --hash lines; the NAR hash
# pins the directory as a whole.
#
# nix/update-wheelhouse-hash computes the hash without nixpkgs (`nix hash path`
# over the directory this same download step fills). While
# nix/wheelhouse-hash.json holds null the build fails closed with Nix's
# "hash mismatch ... got: sha256-..." (lib.fakeHash never matches).
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
# A lock with other wheels must not silently reuse an old wheelhouse hash:
# fail at evaluation with the fix.
assert lib.assertMsg (record.wheels_sha256 == pins.wheelsSha256) ''
  pins/${pins.lockFile} names other wheels (wheel set ${pins.wheelsSha256}) than
  nix/wheelhouse-hash.json was computed for (${record.wheels_sha256}).
  Run nix/update-wheelhouse-hash (or --placeholder, which makes the build fail closed).'';
stdenvNoCC.mkDerivation {
  # The wheel set's hash is in the name: other wheels are another store path,
  # never a stale wheelhouse that happens to carry the old output hash.
  name = "flashnext-wheelhouse-cp312-${builtins.substring 0 16 pins.wheelsSha256}";
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
    inherit (pins) wheelsSha256;
    hashComputed = record.output_hash != null;
  };
}
