# Sourced by the device-session scripts (from the repository root): PYTHONPATH for this tree, plus the serve
# extra's pure-Python wheels when the caller carried them in .whl/ (the device image lacks starlette / uvicorn:
# without them tests/test_serve.py fails at collection and bench_serve.py cannot start).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
