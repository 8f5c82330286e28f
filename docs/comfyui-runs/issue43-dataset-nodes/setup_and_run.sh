#!/usr/bin/env bash
# Real ComfyUI 0.33 check of issue 43 items 2 and 3 (data4): run under flock /work/comfyui/.lock
set -u
C=/work/comfyui; B=/work/comfy-data4/base; R=/work/comfy-data4/run; PORT=8242
PY=$C/venv/bin/python
rm -rf $B; mkdir -p $B/custom_nodes/lowvram-lora
cd /work/wt/data4 && git ls-files --cached --others --exclude-standard -z | xargs -0 -I{} cp --parents {} $B/custom_nodes/lowvram-lora/ 2>/dev/null
$PY -m pip install -q -e $B/custom_nodes/lowvram-lora 2>&1 | tail -2
cd $R && HF_HUB_OFFLINE=1 $PY - <<'PYEOF'
from pathlib import Path
from lowvram_lora.demo_models import DEMO_VARIANT, make_demo_dataset
from lowvram_lora.engine.testing import build_tiny_flux1_pipeline, write_bfl_single_file
B = Path("/work/comfy-data4/base")
pipe = build_tiny_flux1_pipeline(B / "models/diffusers/flux1-tiny", variant=DEMO_VARIANT)  # the demo's architecture, untrained
write_bfl_single_file(pipe, B / "models/diffusion_models/flux1-tiny.safetensors")
make_demo_dataset(B / "input/lowvram_demo/shapes", count=6)
print("assets ready")
PYEOF
cd $C && PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 $PY main.py --cpu --listen 127.0.0.1 --port $PORT --disable-auto-launch --base-directory $B > $R/server.log 2>&1 &
SERVER=$!
for i in $(seq 240); do curl -sf http://127.0.0.1:$PORT/system_stats >/dev/null && break; sleep 1; done
echo "server up after $i s"
cd $R && HF_HUB_OFFLINE=1 $PY checks.py $PORT; echo "checks exit $?"
kill $SERVER; wait $SERVER 2>/dev/null
