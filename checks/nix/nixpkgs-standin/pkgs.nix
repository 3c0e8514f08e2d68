# STAND-IN for the nixpkgs package set, for tests only (checks/nix).
#
# Exactly the attributes flashnext's nix/ files use, under nixpkgs' names and
# with nixpkgs' calling conventions (callPackage fills arguments by name, so a
# nix/ file asking for something nixpkgs lacks fails here too). Every
# derivation is a real `derivation` whose environment is the arguments it was
# given (so tests can read them back, and drvPath changes when they change)
# and whose builder refuses to run: nothing here can be built.
{ system }:
let
  lib = import ./lib.nix;

  refuse = ''
    echo "stand-in derivation $name: checks/nix/nixpkgs-standin evaluates, it cannot build" >&2
    exit 1
  '';

  # Values builtins.derivation cannot put in an environment (attribute sets
  # such as an image config) are recorded as JSON; passthru and meta are not
  # part of the environment in nixpkgs either.
  toEnv = v: if builtins.isAttrs v && !(v ? outPath) then builtins.toJSON v else v;

  mkDerivation =
    args:
    let
      name = args.name or "${args.pname}-${args.version}";
      env = builtins.mapAttrs (_: toEnv) (
        removeAttrs args [
          "passthru"
          "meta"
        ]
      );
      drv = derivation (
        env
        // {
          inherit name system;
          builder = "/bin/sh";
          args = [
            "-c"
            refuse
          ];
        }
      );
    in
    drv
    // args
    // (args.passthru or { })
    // {
      inherit (drv)
        drvPath
        outPath
        type
        name
        ;
      meta = args.meta or { };
    };

  tool = name: mkDerivation { name = "${name}-standin"; };

  stdenv = {
    inherit mkDerivation;
    cc = tool "gcc-wrapper" // {
      cc = tool "gcc" // {
        lib = tool "gcc-lib";
      };
    };
  };

  pythonPackages = {
    pip = tool "python3.12-pip";
    pytest = tool "python3.12-pytest";
    click = tool "python3.12-click";
    rich = tool "python3.12-rich";
    nvidia-ml-py = tool "python3.12-nvidia-ml-py";
    psutil = tool "python3.12-psutil";
    httpx = tool "python3.12-httpx";
    pydantic = tool "python3.12-pydantic";
    safetensors = tool "python3.12-safetensors";
    numpy = tool "python3.12-numpy";
    matplotlib = tool "python3.12-matplotlib";
    setuptools = tool "python3.12-setuptools";
    makePythonPath = lib.makeSearchPath "lib/python3.12/site-packages";
  };

  python312 =
    let
      drv = tool "python3-3.12";
    in
    drv
    // {
      interpreter = "${drv}/bin/python3.12";
      sitePackages = "lib/python3.12/site-packages";
      pythonVersion = "3.12";
      pkgs = pythonPackages;
      withPackages =
        f:
        mkDerivation {
          name = "python3-3.12-env";
          paths = f pythonPackages;
        };
    };

  pkgs = {
    inherit lib stdenv python312;
    stdenvNoCC = {
      inherit mkDerivation;
    };

    callPackage =
      fn: overrides:
      let
        f = if builtins.isFunction fn then fn else import fn;
      in
      f (builtins.intersectAttrs (builtins.functionArgs f) pkgs // overrides);

    runCommand =
      name: env: buildCommand:
      mkDerivation (env // { inherit name buildCommand; });

    writeShellScript =
      name: text:
      mkDerivation {
        inherit name text;
        executable = true;
      };

    writeTextFile =
      {
        name,
        text,
        executable ? false,
        destination ? "",
      }:
      mkDerivation {
        inherit
          name
          text
          executable
          destination
          ;
      };

    mkShell = args: mkDerivation ({ name = "nix-shell"; } // args);

    dockerTools = {
      # Result names as in nixpkgs: stream-NAME (a script), NAME.tar.gz.
      streamLayeredImage =
        args:
        mkDerivation (
          args
          // {
            name = "stream-${args.name}";
            imageName = args.name;
            passthru = (args.passthru or { }) // {
              imageTag = args.tag;
              isExe = true;
            };
          }
        );
      buildLayeredImage =
        args:
        mkDerivation (
          args
          // {
            name = "${args.name}.tar.gz";
            imageName = args.name;
            passthru = (args.passthru or { }) // {
              imageTag = args.tag;
            };
          }
        );
      # /etc/passwd, /etc/group, /etc/nsswitch.conf for images (root, nobody).
      fakeNss = tool "fake-nss";
    };

    cacert = tool "nss-cacert";
    autoPatchelfHook = tool "auto-patchelf-hook";
    autoAddDriverRunpath = tool "auto-add-driver-runpath-hook";
    gnupatch = tool "patch";
    zlib = tool "zlib";
    makeWrapper = tool "make-wrapper";
    ruff = tool "ruff";
    git = tool "git";
    jq = tool "jq";
    podman = tool "podman";
    skopeo = tool "skopeo";
    nixfmt = tool "nixfmt";
  };
in
pkgs
