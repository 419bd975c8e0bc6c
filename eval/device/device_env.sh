# The device machines get a copy of the repo, not a pip install: pyproject maps kernels/ to
# sparsify.kernels, and this symlink does the same there (the one place it is made).
# Sourced by eval/device/h200_*.sh after they put the repo on PYTHONPATH; by hand: source eval/device/device_env.sh
_sparsify_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHONPATH="$_sparsify_root${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import sparsify.kernels" 2>/dev/null \
  || ln -sfn ../kernels "$_sparsify_root/sparsify/kernels"
unset _sparsify_root
