{
  description = "flashnext: Qwen3.8-Flash-Next on 3x RTX 3090 with a patched vLLM 0.33.0 (PP=3)";

  # One input. flake.lock pins it to nixos-26.05 at bd0ff2d3eac2 (2026-06-08),
  # the rev and narHash two unrelated projects' committed locks agree on; where
  # the pair comes from and how to move it: nix/README.md, "The nixpkgs pin".
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";

  outputs =
    { self, nixpkgs }:
    let
      # vLLM's CUDA wheels exist for x86_64-linux only.
      systems = [ "x86_64-linux" ];
      forSystem =
        system:
        # All real work is in nix/outputs.nix, a function of (pkgs, self): checks/nix
        # evaluates it with a stand-in for nixpkgs because nixpkgs cannot be fetched there.
        import ./nix/outputs.nix {
          pkgs = nixpkgs.legacyPackages.${system};
          inherit self;
        };
      perSystem = nixpkgs.lib.genAttrs systems forSystem;
      pick = name: nixpkgs.lib.mapAttrs (_: outputs: outputs.${name}) perSystem;
    in
    {
      packages = pick "packages";
      apps = pick "apps";
      checks = pick "checks";
      devShells = pick "devShells";
      formatter = pick "formatter";
    };
}
