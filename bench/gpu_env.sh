# Set up the GPU machine for the benchmarks; source it from the repository root:
#     source bench/gpu_env.sh
# Needs the wheels in .whl/ (carried with the call: run(..., carry=[".whl", ...])), made here with
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         --platform any -d .whl diffusers==0.42.1 importlib_metadata lazy-importer torchao==0.17.0
# (the machine has torch, transformers, peft, accelerate, safetensors but no diffusers;
# importlib_metadata >= 10 needs lazy-importer). Our package is imported from this checkout
# through a symlink, without pip. torchao 0.17.0 (optimizer=adamw8bit) is carried the same way.
if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_env.sh: no wheels in $PWD/.whl (carry .whl)" >&2
    return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_env.sh: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/lowvram_lora
export PYTHONPATH=/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Only tracked and non-ignored files travel to the GPU machine: fail early if the engine is incomplete.
[ -f engine/models/__init__.py ] || echo "gpu_env.sh: engine/models/ is missing here: is it ignored by git? carry it" >&2
python3 -c "import torch, diffusers, peft; print('gpu_env:', torch.__version__, 'diffusers', diffusers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
