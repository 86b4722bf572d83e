# Sourced by the scripts: installs what a fresh machine lacks (cmake from PyPI; pytest).
# Needs: a Rust toolchain, a C compiler, python3 + pip.
ensure_cmake() {
  if ! command -v cmake >/dev/null 2>&1; then
    echo "== installing cmake (pip)"
    python3 -m pip install -q --disable-pip-version-check cmake >/dev/null
    hash -r
  fi
}
ensure_pytest() {
  if ! python3 -c "import pytest" >/dev/null 2>&1; then
    echo "== installing pytest (pip)"
    python3 -m pip install -q --disable-pip-version-check pytest >/dev/null
  fi
}
ensure_valgrind() {
  if ! command -v valgrind >/dev/null 2>&1; then
    echo "== installing valgrind (apt-get)"
    if ! { apt-get update -qq && apt-get install -y -qq valgrind; } >/dev/null 2>&1; then
      echo "error: valgrind is missing and could not be installed with apt-get (need root and Debian's package lists)" >&2
      return 1
    fi
  fi
}
