# The flake's outputs for one system, as a function of (pkgs, self).
#
# flake.nix calls this with nixpkgs; checks/nix calls it with a stand-in for
# nixpkgs (checks/nix/nixpkgs-standin) so the structure and the arguments of
# every derivation can be evaluated on machines that cannot fetch nixpkgs.
{ pkgs, self }:
let
  inherit (pkgs) lib;

  # The image and the lock use CPython 3.12 (pins/requirements-cp312.txt).
  python = pkgs.python312;

  sources = import ./sources.nix { inherit lib; };
  pins = import ./pins.nix { inherit lib; };

  wheelhouse = pkgs.callPackage ./wheelhouse.nix {
    inherit python pins;
    src = sources.wheelhouse;
  };

  vllm-env = pkgs.callPackage ./vllm-env.nix {
    inherit python pins wheelhouse;
    src = sources.vllmEnv;
  };

  flashnext = pkgs.callPackage ./flashnext.nix {
    inherit vllm-env;
    src = sources.launcher;
    version = pins.launcherVersion;
  };

  # The commit in the tag, so `podman images` tells builds apart.
  imageTag = "${flashnext.version}-${self.shortRev or self.dirtyShortRev or "dirty"}";
  # `./result | podman load`: the tar is streamed, never stored.
  image = pkgs.callPackage ./image.nix {
    inherit flashnext;
    tag = imageTag;
  };
  # The same image as a gzipped docker archive in the store, for `nix copy`,
  # a binary cache or `docker load < result`.
  image-archive = pkgs.callPackage ./image.nix {
    inherit flashnext;
    tag = imageTag;
    stream = false;
  };

  checks = import ./checks.nix {
    inherit
      pkgs
      python
      sources
      vllm-env
      flashnext
      image
      ;
  };

  # `nix run .#preflight -- --model DIR ...` and friends: thin wrappers so the
  # app names match the subcommands.
  subcommandApp =
    name: description:
    let
      script = pkgs.writeShellScript "flashnext-${name}" ''
        exec ${flashnext}/bin/flashnext ${name} "$@"
      '';
    in
    {
      type = "app";
      program = "${script}";
      meta = { inherit description; };
    };

  serveApp = subcommandApp "serve" "Preflight, then serve Qwen3.8-Flash-Next with the patched vLLM";
in
{
  packages = {
    inherit
      wheelhouse
      vllm-env
      flashnext
      image
      image-archive
      ;
    default = flashnext;
  };

  apps = {
    # `flashnext serve` runs the preflight checks itself and refuses on a failure.
    serve = serveApp;
    preflight = subcommandApp "preflight" "Check the host, the model and the table against the plan";
    plan = subcommandApp "plan" "Print the PP partition, VRAM, KV and host-pool plan";
    default = serveApp;
  };

  inherit checks;

  devShells.default = pkgs.mkShell {
    name = "flashnext-dev";
    # What checks/run and the suites call: the launcher's Python with its test
    # tools, GNU patch for patches/apply, podman & co. for checks/containers.
    packages = [
      (python.withPackages (
        ps: with ps; [
          click
          rich
          nvidia-ml-py
          psutil
          httpx
          pydantic
          pytest
          safetensors
          numpy
          pip
          setuptools
        ]
      ))
      pkgs.ruff
      pkgs.gnupatch
      pkgs.git
      pkgs.jq
      pkgs.podman
      pkgs.skopeo
      pkgs.nixfmt
    ];
    shellHook = ''
      export PYTHONPATH="$PWD/launcher/src''${PYTHONPATH:+:$PYTHONPATH}"
    '';
  };

  formatter = pkgs.nixfmt;
}
