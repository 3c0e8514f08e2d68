# Sourced by the flashnext wrapper (nix/flashnext.nix) before exec.
# Triton links its kernel launchers against libcuda and looks for it with
# /sbin/ldconfig, which Nix-built systems and the Nix image do not have. Point
# TRITON_LIBCUDA_PATH at the first directory on LD_LIBRARY_PATH that holds the
# driver's libcuda.so.1 (NixOS: /run/opengl-driver/lib; a container: wherever
# the CDI spec mounted it). A value the user set is left alone.
if [ -z "${TRITON_LIBCUDA_PATH-}" ]; then
  _fn_ifs=$IFS
  IFS=:
  for _fn_dir in ${LD_LIBRARY_PATH-}; do
    if [ -n "$_fn_dir" ] && [ -e "$_fn_dir/libcuda.so.1" ]; then
      export TRITON_LIBCUDA_PATH="$_fn_dir"
      break
    fi
  done
  IFS=$_fn_ifs
  unset _fn_ifs _fn_dir
fi
