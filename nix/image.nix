# The OCI image: the launcher, the patched vLLM env, a CA bundle and a health
# probe; nothing else on PATH, no package manager. `stream = true` gives a
# script that writes the image tar to stdout (`nix build .#image &&
# ./result | podman load`), so the 9 GB tar never lands in the store.
#
# The config must equal the contract documented in containers/README.md;
# checks.image-config compares the two.
{
  lib,
  dockerTools,
  cacert,
  writeTextFile,
  flashnext,
  tag,
  stream ? true,
}:
let
  envPython = "${flashnext.vllm-env}/venv/bin/python";

  # The Quadlet unit's HealthCmd: exit 0 when vLLM's /health answers 200.
  health = writeTextFile {
    name = "flashnext-health";
    destination = "/bin/flashnext-health";
    executable = true;
    text =
      "#!${envPython}\n"
      + lib.removePrefix "#!/usr/bin/env python3\n" (builtins.readFile ../containers/flashnext-health);
  };

  # Where the NVIDIA container toolkit's CDI spec mounts the driver libraries:
  # their host paths (Debian/Ubuntu, RHEL/Fedora), the legacy hook's
  # /usr/local/nvidia, and NixOS's driver link. The hook refreshes
  # /etc/ld.so.cache, which Nix-built programs do not read, hence the path.
  driverLibraryPath = lib.concatStringsSep ":" [
    "/usr/lib/x86_64-linux-gnu"
    "/usr/lib64"
    "/usr/local/nvidia/lib64"
    "/run/opengl-driver/lib"
  ];

  config = {
    Entrypoint = [
      (lib.getExe flashnext)
      "serve"
    ];
    Env = [
      "PATH=/bin"
      "LD_LIBRARY_PATH=${driverLibraryPath}"
      "SSL_CERT_FILE=/etc/ssl/certs/ca-bundle.crt"
      "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
      "HOME=/tmp"
      # Inside the container's network namespace; `-p 127.0.0.1:8000:8000`
      # decides who can reach it from the host.
      "FLASHNEXT_HOST=0.0.0.0"
      # vLLM, Triton and torch caches: mount a volume here to keep compiled
      # kernels across restarts (containers/README.md).
      "XDG_CACHE_HOME=/var/cache/flashnext"
    ];
    ExposedPorts = {
      "8000/tcp" = { };
    };
    Labels = {
      "org.opencontainers.image.title" = "flashnext";
      "org.opencontainers.image.version" = flashnext.version;
    };
  };

  build = if stream then dockerTools.streamLayeredImage else dockerTools.buildLayeredImage;
in
build {
  name = "flashnext";
  inherit tag config;
  contents = [
    flashnext
    health
    cacert
  ];
  # Writable scratch for Triton, torch and pip-less Python; sticky like a host's /tmp.
  extraCommands = ''
    mkdir -m 1777 tmp
    mkdir -p var/cache
    mkdir -m 1777 var/cache/flashnext
  '';
  passthru.imageConfig = config;
}
