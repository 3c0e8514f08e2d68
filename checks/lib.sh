# Shared by checks/run and ./flashnext: the launcher's own small venv.
# Keyed by launcher/pyproject.toml and the checkout, so a dependency change
# builds a new one; the launcher is installed editable from this checkout.
: "${FLASHNEXT_CACHE:=$HOME/.cache/flashnext}"
export FLASHNEXT_CACHE

launcher_venv() {
  local repo=$1 extras=${2:-} py=${FLASHNEXT_PYTHON:-python3}
  local key venv
  # The checkout's path is part of the key: the launcher is installed editable,
  # so two checkouts must not share (and re-point) one venv.
  key=$( { cat "$repo/launcher/pyproject.toml"; "$py" -c 'import sys; print(sys.version)'; echo "$extras $repo"; } \
        | sha256sum | cut -c1-16)
  venv="$FLASHNEXT_CACHE/launcher/$key"
  # Venvs are not relocatable, so build in place; .complete is written last
  # and a venv without it (an interrupted build) is rebuilt from scratch.
  if [ ! -e "$venv/.complete" ]; then
    echo "flashnext: building the launcher venv in $venv (one time)" >&2
    rm -rf "$venv" && "$py" -m venv "$venv" || return 1
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      setuptools wheel "$repo/launcher${extras:+[$extras]}" >&2 || return 1
    "$venv/bin/pip" uninstall --quiet --yes flashnext >&2 || return 1
    printf '%s\n' "$repo" > "$venv/.checkout"
    touch "$venv/.complete"
    prune_launcher_venvs
  fi
  # Editable, no deps: a few hundred ms, and always this checkout's code.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -e "$repo/launcher" >&2 || return 1
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
