# STAND-IN FOR NIXPKGS, for tests only (checks/nix). Not nixpkgs.
#
# nixpkgs cannot be fetched on the machines CI runs on, and Nix 2.8 there
# cannot evaluate current nixpkgs. This flake provides exactly the nixpkgs
# attributes flashnext's nix/ files use, with nixpkgs' names and calling
# conventions, so `nix flake show/check --override-input nixpkgs <this>` can
# evaluate flashnext's whole output tree and every derivation's arguments.
# Its derivations record their arguments and refuse to build.
{
  description = "Stand-in for nixpkgs (flashnext checks/nix only)";
  outputs =
    { self }:
    {
      lib = import ./lib.nix;
      legacyPackages.x86_64-linux = import ./pkgs.nix { system = "x86_64-linux"; };
    };
}
