#!/usr/bin/env bash
# The default suite on the oldest torch and transformers that pyproject.toml accepts (its
# ">=" bounds: torch 2.11 and transformers 5.17, what the lent GPU machine has), in a venv
# of their own. Run it after a change that touches a torch API: DCP, FSDP2 and inductor change
# between releases, and a GPU window is too short to find that out in.
#   bash scripts/test_oldest.sh [VENV_DIR] [pytest options]   # VENV_DIR default: .venv-oldest
#   PYTHON=python3.12 bash scripts/test_oldest.sh             # the GPU machine's Python
#   PYTHON=python3.10 bash scripts/test_oldest.sh .venv-py310  # the oldest Python pyproject accepts
# PyPI's x86_64 torch 2.11 is its CUDA build (about 3 GB with its NVIDIA libraries); it runs
# on the CPU. A second run reuses VENV_DIR (pip installs nothing new).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-oldest}
[ $# -gt 0 ] && shift
python=${PYTHON:-python3}
read -r torch_min tf_min < <("$python" -c '
import re
low = dict(re.findall(r"\"(torch|transformers)\s*>=\s*([0-9.]+)", open("pyproject.toml").read()))
print(low["torch"], low["transformers"])')
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$torch_min" "transformers==$tf_min"
"$venv/bin/python" -m pip install -q -e ".[dev]"
"$venv/bin/python" -c '
import sys, torch, transformers
have = (torch.__version__.split("+")[0], transformers.__version__)
print(f"[test_oldest] Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {have[1]}")
if any(v != m and not v.startswith(m + ".") for v, m in zip(have, sys.argv[1:])):  # [dev] pulled newer
    sys.exit(f"[test_oldest] expected torch {sys.argv[1]} and transformers {sys.argv[2]}, have {have}")
' "$torch_min" "$tf_min"
exec "$venv/bin/python" -m pytest -q -n auto -p no:cacheprovider "$@"
