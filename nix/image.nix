# The container image (a Docker archive, so its healthcheck survives): the
# launcher, the patched vLLM env, a CA bundle, a health probe and
# /etc/passwd + /etc/group (dockerTools.fakeNss: root and nobody, so
# getpwuid() and `~` resolve); nothing else on PATH, no package manager.
# `stream = true` (packages.image) gives a script that writes the image tar to
# stdout (`nix build .#image && ./result | podman load`), so the 9 GB tar never
# lands in the store; `stream = false` (packages.image-archive) builds the
# gzipped tar into the store for machines that copy or cache it.
#
# The config must equal the contract documented in containers/README.md;
# checks.image-config compares the two, and checks/containers loads this
# config into podman and compares what `podman image inspect` reports.
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

  # Durations in a Docker image config's Healthcheck are nanoseconds.
  seconds = n: n * 1000000000;

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
    # As the run line's --health-* flags and the Quadlet unit: /health answers
    # 200. Cold starts take 10-35 minutes (weights, cudagraphs), hence the
    # start period. A Docker-format key: podman keeps it on `podman load`.
    Healthcheck = {
      Test = [
        "CMD"
        "flashnext-health"
      ];
      Interval = seconds 30;
      Timeout = seconds 10;
      StartPeriod = seconds (35 * 60);
      Retries = 3;
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
    dockerTools.fakeNss
  ];
  # Writable scratch for Triton, torch and pip-less Python; sticky like a host's /tmp.
  extraCommands = ''
    mkdir -m 1777 tmp
    mkdir -p var/cache
    mkdir -m 1777 var/cache/flashnext
  '';
  passthru.imageConfig = config;
}
