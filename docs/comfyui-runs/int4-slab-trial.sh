#!/usr/bin/env bash
# Real ComfyUI trial of precision 'int4 slab' (run under flock /work/comfyui/.lock)
set -e
D=/work/comfy-int4; C=/work/comfyui; PY=$C/venv/bin/python
rm -rf $D; mkdir -p $D/custom_nodes/lowvram-lora $D/models/diffusers $D/models/diffusion_models $D/input $D/home
cd /work/wt/int4 && git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents {} $D/custom_nodes/lowvram-lora/ 2>/dev/null || true
cp -r $C/models/diffusers/flux1-tiny $D/models/diffusers/
cp -r $C/input/lowvram_demo $D/input/
echo "git HEAD: $(git -C /work/wt/int4 rev-parse --short HEAD)"
$PY -m pip install -q -e $D/custom_nodes/lowvram-lora
HF_HUB_OFFLINE=1 $PY -c "
from lowvram_lora.engine.testing import write_bfl_single_file
print(write_bfl_single_file('$D/models/diffusers/flux1-tiny', '$D/models/diffusion_models/flux1-tiny.safetensors'))"
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
cd $C; PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 $PY main.py --cpu --listen 127.0.0.1 --port $PORT --disable-auto-launch --base-directory $D > $D/server.log 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null' EXIT  # the server inherits the lock: never leave it running
for i in $(seq 240); do curl -sf http://127.0.0.1:$PORT/system_stats >/dev/null && break; sleep 1; done
curl -s http://127.0.0.1:$PORT/object_info/LowVRAMLoadQuantizedSlab | $PY -c "import json,sys; d=json.load(sys.stdin)['LowVRAMLoadQuantizedSlab']['input']['required']['precision']; print('precision choices:', d[0] if isinstance(d[0], list) else d[1].get('options'))"
$PY - <<PYEOF
import json
g = json.load(open("$D/custom_nodes/lowvram-lora/example_workflows/api/demo_tiny_lora.json"))
g["1"]["inputs"]["precision"] = "int4 slab"
g["4"]["inputs"].update(steps=10, sample_every=0, sample_at_start=False)
g["5"]["inputs"]["filename_prefix"] = "loras/demo_int4"
json.dump(g, open("$D/int4_api.json", "w"))
PYEOF
echo "\$ comfy --skip-prompt --workspace $C run --workflow $D/int4_api.json --host 127.0.0.1 --port $PORT --wait --timeout 600"
set +e
HOME=$D/home DO_NOT_TRACK=1 COMFY_NO_TELEMETRY=1 COMFY_NO_UPDATE_CHECK=1 $C/venv/bin/comfy --skip-prompt --workspace $C run --workflow $D/int4_api.json --host 127.0.0.1 --port $PORT --wait --timeout 600
echo "comfy run exit code: $?"
curl -s http://127.0.0.1:$PORT/internal/logs | $PY -c "import json,sys; t=json.load(sys.stdin); t = t if isinstance(t,str) else json.dumps(t); import re; [print(l) for l in t.split('\n') if 'lowvram' in l.lower() or 'int4' in l or 'slab' in l or 'Traceback' in l or 'Error' in l][-40:]" | tail -40
ls -la $D/models/slabs/ $D/output/loras/
kill $SRV; wait $SRV 2>/dev/null
