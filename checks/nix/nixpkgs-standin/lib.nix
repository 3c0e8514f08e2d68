# STAND-IN for the parts of nixpkgs' lib that flashnext's nix/ files call.
# Where the real function's behaviour matters to a test (fileset filtering,
# importJSON, assertMsg, getExe), this implements it; nothing more.
let
  inherit (builtins)
    all
    any
    concatStringsSep
    filter
    isList
    listToAttrs
    map
    pathExists
    ;

  hasPrefix = pre: s: builtins.substring 0 (builtins.stringLength pre) s == pre;

  flatten = xs: if isList xs then builtins.concatMap flatten xs else [ xs ];
in
rec {
  inherit concatStringsSep;

  genAttrs =
    names: f:
    listToAttrs (
      map (n: {
        name = n;
        value = f n;
      }) names
    );
  mapAttrs = builtins.mapAttrs;

  removePrefix =
    pre: s:
    if hasPrefix pre s then
      builtins.substring (builtins.stringLength pre) (builtins.stringLength s) s
    else
      s;

  importJSON = path: builtins.fromJSON (builtins.readFile path);

  assertMsg = pred: msg: pred || builtins.throw msg;

  makeBinPath = drvs: concatStringsSep ":" (map (d: "${d}/bin") drvs);
  makeSearchPath = sub: drvs: concatStringsSep ":" (map (d: "${d}/${sub}") drvs);

  getExe =
    drv:
    if drv ? meta.mainProgram then
      "${drv}/bin/${drv.meta.mainProgram}"
    else
      throw "stand-in lib.getExe: ${drv.name} has no meta.mainProgram";

  # nixpkgs' lib.fakeHash: an SRI hash no real output has.
  fakeHash = "sha256-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

  # lib.fileset, for file sets given as paths (files or directories). Like the
  # real one: a missing path is an error, and toSource copies exactly the
  # selected files (with the directories above them) under `root`.
  fileset = {
    unions = sets: flatten sets;

    toSource =
      { root, fileset }:
      let
        files = flatten fileset;
        missing = filter (p: !pathExists p) files;
        rootStr = toString root;
        wanted = map toString files;
        keep =
          path: _type:
          any (w: path == w || hasPrefix (w + "/") path || hasPrefix (path + "/") w) wanted;
      in
      if missing != [ ] then
        throw "lib.fileset.toSource: path does not exist: ${toString (builtins.head missing)}"
      else if !all (w: hasPrefix (rootStr + "/") w) wanted then
        throw "lib.fileset.toSource: a file set element is outside root ${rootStr}"
      else
        builtins.path {
          name = "source";
          path = root;
          filter = keep;
        };
  };
}
