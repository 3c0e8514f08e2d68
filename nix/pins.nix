# What the Nix side reads from pins/: the one place versions and hashes live.
{ lib }:
let
  vllmToml = builtins.fromTOML (builtins.readFile ../pins/vllm.toml);
  launcherToml = builtins.fromTOML (builtins.readFile ../launcher/pyproject.toml);
  # The image's Python; pins/vllm.toml names the lock for it and its sha256.
  lock = vllmToml.lock."3.12";
  lockSha256 = builtins.hashFile "sha256" (../pins + "/${lock.file}");
in
# pins/build-env refuses a lock whose hash differs from vllm.toml; so does Nix.
assert lib.assertMsg (lockSha256 == lock.sha256) ''
  pins/${lock.file} has sha256 ${lockSha256}, pins/vllm.toml records ${lock.sha256}:
  the lock was edited by hand. Restore it or regenerate both with pins/lock.'';
{
  vllmVersion = vllmToml.vllm.version;
  launcherVersion = launcherToml.project.version;
  lockFile = lock.file;
  inherit lockSha256;
  # nix/wheelhouse-hash.json records the wheelhouse's NAR hash together with
  # the lock it was computed from (nix/update-wheelhouse-hash writes it).
  wheelhouseHash = lib.importJSON ./wheelhouse-hash.json;
}
