# What the Nix side reads from pins/: the one place versions and hashes live.
{ lib }:
let
  vllmToml = builtins.fromTOML (builtins.readFile ../pins/vllm.toml);
  launcherToml = builtins.fromTOML (builtins.readFile ../launcher/pyproject.toml);
  lockFile = ../pins/requirements-cp312.txt;
in
{
  vllmVersion = vllmToml.vllm.version;
  launcherVersion = launcherToml.project.version;
  inherit lockFile;
  lockSha256 = builtins.hashFile "sha256" lockFile;
  # nix/wheelhouse-hash.json records the wheelhouse's NAR hash together with
  # the lock it was computed from (nix/update-wheelhouse-hash writes it).
  wheelhouseHash = lib.importJSON ./wheelhouse-hash.json;
}
