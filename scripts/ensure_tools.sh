# Sourced by the scripts: what a fresh machine lacks goes into a virtual environment of the
# project's own (build/venv, or $GPUPOOL_VENV), so nothing is pip-installed into the system
# Python (Debian's and Ubuntu's refuse that: "externally-managed-environment").
# Needs: a Rust toolchain, a C compiler, python3 (with its venv module; on Debian/Ubuntu the
# python3-venv package, installed here with apt-get when missing and possible).
ensure_venv() {
  VENV=${GPUPOOL_VENV:-$PWD/build/venv}
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating the tools' virtual environment ($VENV)"
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
      rm -rf "$VENV"
      if command -v apt-get >/dev/null 2>&1 && { apt-get update -qq && apt-get install -y -qq python3-venv; } >/dev/null 2>&1 \
         && python3 -m venv "$VENV"; then :; else
        echo "error: python3 cannot create a virtual environment; install your distribution's python3-venv package" >&2
        return 1
      fi
    fi
  fi
  export PATH="$VENV/bin:$PATH"
  hash -r
}
ensure_cmake() {
  if ! command -v cmake >/dev/null 2>&1; then
    ensure_venv
    echo "== installing cmake (pip, into $VENV)"
    python -m pip install -q --disable-pip-version-check cmake >/dev/null
    hash -r
  fi
}
ensure_pytest() {
  if ! python3 -c "import pytest" >/dev/null 2>&1; then
    ensure_venv
    if ! python -c "import pytest" >/dev/null 2>&1; then
      echo "== installing pytest (pip, into $VENV)"
      python -m pip install -q --disable-pip-version-check pytest >/dev/null
    fi
  fi
}
ensure_pkgconfig() {
  if ! command -v pkg-config >/dev/null 2>&1; then
    echo "== installing pkg-config (apt-get)"
    if ! { apt-get update -qq && apt-get install -y -qq pkg-config; } >/dev/null 2>&1; then
      echo "error: pkg-config is missing and could not be installed with apt-get (need root and Debian's package lists)" >&2
      return 1
    fi
    hash -r
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
