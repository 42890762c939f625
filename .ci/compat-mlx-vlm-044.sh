#!/usr/bin/env bash
# Compatibility check with mlx-vlm 0.4.4, the version in the original bug report.
#
# mlx-vlm 0.4.4 makes its generation_stream with mx.new_stream at import time
# (a plain stream owned by the importing thread). Beside mlx[cpu] 0.32.4 on
# Linux this reproduces the bug with no Mac: tests/compat asserts that
#   (a) load on the main thread + asyncio.to_thread(generate) raises
#       "There is no Stream(cpu, 0) in current thread.", and
#   (b) the same through mlx_pinned.MLXThread generates every token.
#
# Usage: .ci/compat-mlx-vlm-044.sh [VENV] [PYTEST ARGS...]
#   VENV         the compat virtualenv (default: $COMPAT_VENV, else .venv-compat044);
#                created if missing, reused if present.
#   PYTHON       interpreter for a new venv (default: python3; 3.10 or newer).
#   MAIN_PYTHON  python of the main (mlx-vlm 0.7.10) environment: makes the tiny
#                model if the compat venv cannot (mlx_pinned.testing before the
#                0.4.4 fix to _build_specs); e.g. MAIN_PYTHON=.venv/bin/python
#   COMPAT_MODEL where to write the tiny model (default: VENV/tiny-vlm).
# Linux x86_64 (mlx[cpu] wheels). Needs the package index; the tests are offline.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${1:-${COMPAT_VENV:-.venv-compat044}}"
[ "$#" -gt 0 ] && shift
PYTHON="${PYTHON:-python3}"
MAIN_PYTHON="${MAIN_PYTHON:-}"
MODEL="${COMPAT_MODEL:-$VENV/tiny-vlm}"
VPY="$VENV/bin/python"

step() { printf '\n== %s\n' "$*"; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# What the tests need. mlx-vlm 0.4.4 only asks for transformers>=5.1.0 and
# mlx-lm>=0.31.0; every transformers 5.x tried (5.1.0 to 5.24.0) behaves the
# same without torchvision (see tests/compat), so take the newest that was tested.
cat >"$WORK/requirements.txt" <<'EOF'
mlx[cpu]==0.32.4
mlx-vlm==0.4.4
mlx-lm==0.32.2
transformers==5.24.0
tokenizers==0.23.3
huggingface-hub==2.4.0
anyio==4.16.0
sniffio==1.3.1
pytest==9.2.0
pytest-timeout==2.4.0
EOF

# Everything else, exactly as installed when this check was written (no torch).
cat >"$WORK/constraints.txt" <<'EOF'
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
datasets==5.2.0
dill==0.4.1
fastapi==0.165.0
filelock==4.3.1
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
iniconfig==2.3.1
Jinja2==3.1.6
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
miniaudio==1.71
mlx==0.32.4
mlx-cpu==0.32.4
mlx-lm==0.32.2
mlx-vlm==0.4.4
multiprocess==0.70.19
numpy==2.4.6
opencv-python==5.0.0.93
opentelemetry-api==1.45.2
packaging==26.4
pandas==3.1.1
pillow==13.0.0
pluggy==1.7.0
protobuf==7.36.2
pyarrow==26.0.1
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
pytest==9.2.0
pytest-timeout==2.4.0
python-dateutil==4.0.0
PyYAML==6.0.4
regex==2026.11.19
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
sentencepiece==0.2.3
shellingham==1.5.4
sniffio==1.3.1
starlette==1.10.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
tzdata==2026.6
urllib3==2.8.0
uvicorn==0.54.0
xxhash==4.1.0
EOF

if [ ! -x "$VPY" ]; then
    step "creating $VENV with $PYTHON"
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), sys.version'
    "$PYTHON" -m venv "$VENV"
fi

step "installing mlx-vlm 0.4.4 beside mlx[cpu] 0.32.4"
started=$SECONDS
"$VPY" -m pip install --quiet --disable-pip-version-check \
    -r "$WORK/requirements.txt" -c "$WORK/constraints.txt"
echo "installed in $((SECONDS - started)) s"
"$VPY" -m pip check --disable-pip-version-check
"$VPY" - <<'EOF'
import importlib.metadata as md
for dist in ("mlx", "mlx-vlm", "mlx-lm", "transformers"):
    print(f"{dist} {md.version(dist)}")
EOF

# The repository itself, without its dependencies (its [server] extra pins
# mlx-vlm 0.7.10).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step "making the tiny Qwen3-VL model at $MODEL"
make_model='import sys; from mlx_pinned.testing import make_tiny_vlm; make_tiny_vlm(sys.argv[1], overwrite=True)'
if "$VPY" -c "$make_model" "$MODEL" 2>"$WORK/make.log"; then
    echo "made with mlx-vlm 0.4.4 ($VPY)"
elif [ -n "$MAIN_PYTHON" ]; then
    echo "mlx_pinned.testing cannot build the model with mlx-vlm 0.4.4:"
    tail -n 1 "$WORK/make.log"
    "$MAIN_PYTHON" -c "$make_model" "$MODEL"
    echo "made with the main environment ($MAIN_PYTHON)"
else
    cat "$WORK/make.log" >&2
    echo "error: the compat venv cannot make the tiny model; set MAIN_PYTHON to the" \
        "main environment's python (for example MAIN_PYTHON=.venv/bin/python)." >&2
    exit 1
fi

step "pytest tests/compat"
export MLX_PINNED_COMPAT_MODEL="$MODEL"
# --confcutdir: tests/conftest.py belongs to the main environment (hypothesis, ...).
exec "$VPY" -m pytest tests/compat -q --confcutdir=tests/compat -p no:cacheprovider "$@"
