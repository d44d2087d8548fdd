#!/usr/bin/env bash
# Runs the GPU benchmarks section by section into one RESULTS.md, on a machine with a GPU.
#
#   bash benchmarks/gpu.sh OUT_DIR [SECTION ...] [-- EXTRA run.py FLAGS]
#
# Each section is its own `run.py --merge` invocation, so a run stopped part-way keeps
# what it finished. Wheels in .whl/ (jmp, keras and its needs, for an image without them)
# are installed into /tmp/site first. JAXAMP_GIT_REVISION names the commit when the tree
# has no .git.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR [SECTION ...] [-- FLAGS]}; shift
sections=(); while (($#)) && [[ $1 != -- ]]; do sections+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
((${#sections[@]})) || sections=(lm matmul overhead resnet)
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$root"/.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
$py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" || exit 1
mkdir -p "$out"
for s in "${sections[@]}"; do
  echo "=== $s ($(date -u +%H:%M:%S))"
  $py "$root/benchmarks/run.py" --size gpu --only "$s" --out "$out" --merge "$@" || echo "=== $s FAILED: $?"
done
