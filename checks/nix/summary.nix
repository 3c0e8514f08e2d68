# For checks/nix/test_flake.py: evaluate flashnext's nix/outputs.nix with the
# nixpkgs STAND-IN and return, as JSON-friendly data, what the tests assert
# (derivation arguments, filtered sources, drvPaths). Nothing is built.
{ root }:
let
  pkgs = import ./nixpkgs-standin/pkgs.nix { system = "x86_64-linux"; };
  out = import (root + "/nix/outputs.nix") {
    inherit pkgs;
    self = {
      shortRev = "abcdef0";
    };
  };
  p = out.packages;
  drvPaths = builtins.mapAttrs (_: d: d.drvPath);
in
{
  drvPaths = {
    packages = drvPaths p;
    checks = drvPaths out.checks;
  };
  # A fixed-output path depends on its name and hash only, not on its inputs.
  wheelhouseOutPath = p.wheelhouse.outPath;

  wheelhouse = {
    inherit (p.wheelhouse)
      name
      outputHash
      outputHashMode
      outputHashAlgo
      buildPhase
      hashComputed
      ;
    src = "${p.wheelhouse.src}";
  };

  vllmEnv = {
    inherit (p.vllm-env)
      name
      version
      buildPhase
      installCheckPhase
      doInstallCheck
      postPatch
      autoPatchelfIgnoreMissingDeps
      dontStrip
      ;
    src = "${p.vllm-env.src}";
    hooks = map (d: d.name) p.vllm-env.nativeBuildInputs;
    wheelhouse = "${p.wheelhouse}";
  };

  flashnext = {
    inherit (p.flashnext) name version buildPhase postFixup;
    mainProgram = p.flashnext.meta.mainProgram;
    src = "${p.flashnext.src}";
    vllmEnv = "${p.vllm-env}";
    out = "${p.flashnext}";
  };

  image = {
    inherit (p.image) name imageTag extraCommands;
    config = p.image.imageConfig;
    contents = map toString p.image.contents;
  };

  imageArchive = {
    inherit (p.image-archive) name imageTag extraCommands;
    config = p.image-archive.imageConfig;
    contents = map toString p.image-archive.contents;
  };

  default = p.default.drvPath == p.flashnext.drvPath;

  apps = builtins.mapAttrs (_: app: {
    inherit (app) type program;
    drvs = builtins.attrNames (builtins.getContext app.program);
  }) out.apps;

  checks = builtins.mapAttrs (_: c: {
    inherit (c) name;
    script = c.buildCommand or "";
    src = if c ? src then "${c.src}" else null;
  }) out.checks;

  devShellPackages = map (d: d.name) out.devShells.default.packages;
  formatter = out.formatter.name;
}
