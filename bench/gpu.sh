#!/usr/bin/env bash
# The accelerator figures (issue 39) on one lent H100 or H200, in under 8 minutes:
#
#     bash bench/gpu.sh [gpu.py options]          # e.g. --budget 420, --only train-llama1b
#     PYTHON=.venv/bin/python bash bench/gpu.sh --quick --out /tmp/gpu   # the same logic on CPU
#
# A lent GPU machine has its own Python 3.12 with jax 0.11, torch, transformers, equinox, optax and
# tensorstore, and reaches no package index. What levanter-core needs beyond that travels as
# wheels in .whl/ (bench/README.md, "On a lent GPU", says which and how to fetch them); they go
# into $SITE, which is put first on PYTHONPATH, beside a sitecustomize.py that gives haliax back
# the jax.core.is_constant_dim that jax 0.11 removed. The core and the plugins the parts use are
# then installed editable into that Python, without their dependencies.
#
# Figures go to $OUT (default bench/gpu-out): summary.json, summary.md and gpu.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/gpu-out}
SITE=${SITE:-/tmp/levanter-site}

# Here, before a lease: `bash bench/gpu.sh --fetch-wheels` puts those wheels into .whl/ (and keeps
# git from seeing them).
WHEELS="haliax==1.4.dev453 jmp==0.0.4 aqtp==0.9.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
typing-inspection==0.4.5 zstandard==0.25.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0 jiwer==4.0.0
rapidfuzz==3.14.6 espeakng-loader==0.2.4"
if [ "${1:-}" = "--fetch-wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    # shellcheck disable=SC2086
    exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $WHEELS
fi

if [ -d "$SITE" ]; then  # installed by an earlier call on this machine
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import levanter_core, levanter_model_llama" 2>/dev/null; then
    echo "[gpu.sh] installing levanter-core into $("$PY" -c 'import sys; print(sys.prefix)')"
    mkdir -p "$SITE"
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
    cat >"$SITE/sitecustomize.py" <<'EOF'
"""jax 0.11 removed jax.core.is_constant_dim, which haliax 1.4.dev453 still calls."""
import operator

import jax.core

if not hasattr(jax.core, "is_constant_dim"):

    def is_constant_dim(d):
        try:
            operator.index(d)
            return True
        except TypeError:
            return False

    jax.core.is_constant_dim = is_constant_dim
EOF
    case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-cache-dir \
        -e . -e plugins/models-llama -e plugins/models-gpt2 -e plugins/models-whisper -e plugins/audio
fi

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
fi
"$PY" -c "import jax; print('[gpu.sh] jax', jax.__version__, jax.devices())"
exec "$PY" bench/gpu.py --out "$OUT" "$@"
