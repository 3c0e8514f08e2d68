# Shared by checks/run and ./flashnext: the launcher's own small venv.
# It holds the launcher's dependencies only (launcher/pyproject.toml); the
# launcher itself is imported from this checkout's launcher/src through a .pth
# file. So a call runs no pip and writes nothing into the checkout (a read-only
# checkout works), and an edit of the sources is live at once. The key covers
# pyproject.toml (a dependency change builds a new venv), the interpreter and
# the checkout's path (two checkouts never share one venv).
: "${FLASHNEXT_CACHE:=$HOME/.cache/flashnext}"
export FLASHNEXT_CACHE

launcher_venv_key() {
  local repo=$1 extras=${2:-} py=${3:-${FLASHNEXT_PYTHON:-python3}}
  { cat "$repo/launcher/pyproject.toml"; "$py" -c 'import sys; print(sys.version)'; echo "$extras $repo"; } \
    | sha256sum | cut -c1-16
}

# The requirements of launcher/pyproject.toml ([project] dependencies, plus the
# optional-dependencies group $2), one per line.
launcher_requirements() {
  local repo=$1 extras=${2:-} py=${3:-${FLASHNEXT_PYTHON:-python3}}
  "$py" - "$repo/launcher/pyproject.toml" "$extras" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as fh:
    project = tomllib.load(fh)["project"]
extras = [e for e in sys.argv[2].split(",") if e]
for req in project.get("dependencies", []) + [
    r for e in extras for r in project.get("optional-dependencies", {})[e]
]:
    print(req)
PY
}

# The cache directory must be one: a file there (a typo, a stale mount point)
# would fail deep inside `python -m venv` with a bare errno.
cache_dir_usable() {
  local where="FLASHNEXT_CACHE=$FLASHNEXT_CACHE"
  if [ -e "$FLASHNEXT_CACHE" ] && [ ! -d "$FLASHNEXT_CACHE" ]; then
    echo "flashnext: $where is not a directory; fix: point FLASHNEXT_CACHE at a directory" \
      "(export FLASHNEXT_CACHE=\$HOME/.cache/flashnext) or unset it" >&2
    return 1
  fi
  if ! mkdir -p "$FLASHNEXT_CACHE" 2>/dev/null || [ ! -w "$FLASHNEXT_CACHE" ]; then
    echo "flashnext: $where cannot be created or written by $(id -un);" \
      "fix: point FLASHNEXT_CACHE at a directory you can write, or unset it" >&2
    return 1
  fi
}

launcher_venv() {
  local repo=$1 extras=${2:-} py=${FLASHNEXT_PYTHON:-python3}
  local key venv site reqs
  cache_dir_usable || return 1
  key=$(launcher_venv_key "$repo" "$extras" "$py") || return 1
  venv="$FLASHNEXT_CACHE/launcher/$key"
  # Venvs are not relocatable, so build in place; .complete is written last
  # and a venv without it (an interrupted build) is rebuilt from scratch.
  if [ ! -e "$venv/.complete" ]; then
    echo "flashnext: building the launcher venv in $venv (one time)" >&2
    mapfile -t reqs < <(launcher_requirements "$repo" "$extras" "$py") || return 1
    [ "${#reqs[@]}" -gt 0 ] || return 1
    rm -rf "$venv" && "$py" -m venv "$venv" || return 1
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${reqs[@]}" >&2 || return 1
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
      || return 1
    printf '%s\n' "$repo/launcher/src" > "$site/flashnext-checkout.pth"
    printf '%s\n' "$repo" > "$venv/.checkout"
    touch "$venv/.complete"
    prune_launcher_venvs
  fi
  echo "$venv"
}

# A venv per checkout: drop those whose checkout is gone (a deleted clone),
# ~100 MB each. Only venvs that recorded their checkout are touched.
prune_launcher_venvs() {
  local marker checkout
  for marker in "$FLASHNEXT_CACHE"/launcher/*/.checkout; do
    [ -e "$marker" ] || continue
    checkout=$(head -n 1 "$marker")
    if [ -n "$checkout" ] && [ ! -e "$checkout/launcher/pyproject.toml" ]; then
      echo "flashnext: removing the launcher venv of the deleted checkout $checkout" >&2
      rm -rf "$(dirname "$marker")"
    fi
  done
}
