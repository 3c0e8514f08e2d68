# What the Nix side reads from pins/: the one place versions and hashes live.
{ lib }:
let
  vllmToml = builtins.fromTOML (builtins.readFile ../pins/vllm.toml);
  launcherToml = builtins.fromTOML (builtins.readFile ../launcher/pyproject.toml);
  # The image's Python; pins/vllm.toml names the lock for it and its sha256.
  lock = vllmToml.lock."3.12";
  lockText = builtins.readFile (../pins + "/${lock.file}");
  lockSha256 = builtins.hashString "sha256" lockText;
  # The wheelhouse holds exactly the files these hashes name: hash the sorted
  # list, so a lock rewritten with the same wheels (comments, extras, order)
  # keeps its wheelhouse. nix/update-wheelhouse-hash computes the same value.
  wheelHashes = map builtins.head (
    builtins.filter builtins.isList (builtins.split "--hash=sha256:([0-9a-f]{64})" lockText)
  );
  wheelsSha256 = builtins.hashString "sha256" (
    lib.concatStringsSep "\n" (builtins.sort builtins.lessThan wheelHashes)
  );
in
# pins/build-env refuses a lock whose hash differs from vllm.toml; so does Nix.
assert lib.assertMsg (lockSha256 == lock.sha256) ''
  pins/${lock.file} has sha256 ${lockSha256}, pins/vllm.toml records ${lock.sha256}:
  the lock was edited by hand. Restore it or regenerate both with pins/lock.'';
{
  vllmVersion = vllmToml.vllm.version;
  launcherVersion = launcherToml.project.version;
  lockFile = lock.file;
  inherit wheelsSha256;
  # nix/wheelhouse-hash.json records the wheelhouse's NAR hash together with
  # the wheel set it was computed for (nix/update-wheelhouse-hash writes it).
  wheelhouseHash = lib.importJSON ./wheelhouse-hash.json;
}
