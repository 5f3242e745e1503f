# Sourced by .ci/run and .ci/compat: `install PYTHON ARGS...` installs
# ARGS (pip's arguments) into the venv of PYTHON, by uv where the CI venv
# has it (.ci/run installs it there), else by that venv's pip. uv installs
# the same pinned set in about a quarter of pip's time (26 s against 95 s
# for the test set on the 2-core machine: pip unpacks TensorFlow, JAX and
# PyTorch one file at a time). uv reads no pip configuration, so pip's
# find-links (a machine's own wheels) are handed over. uv compiles the
# bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (this
# machine's environment) Python would otherwise compile Keras and its
# backend from source in every process, and write nothing: `import keras`
# 15 CPU-s on TensorFlow instead of 6, 9 on JAX instead of 3.3, in each of
# the suite's workers and subprocesses, against 43 CPU-s once here.
install() {
  local python="$1"
  shift
  local uv
  uv="$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/uv"
  if [ -x "$uv" ]; then
    local find_links=()
    local link
    for link in ${PIP_FIND_LINKS:-} \
      $("$python" -m pip config get global.find-links 2>/dev/null || true); do
      find_links+=(--find-links "$link")
    done
    "$uv" pip install -q --compile-bytecode --python "$python" \
      "${find_links[@]}" "$@"
  else
    "$python" -m pip install -q --upgrade pip
    "$python" -m pip install -q "$@"
  fi
}
