"""Load Quantized Slab: pick the base transformer; checks it, loads nothing yet."""
from __future__ import annotations

from . import schema as io
from .paths import list_transformer_choices, resolve_choice, slab_dir

CATEGORY = "LowVRAM LoRA"
#: precision -> the slab's bits (None: the checkpoint as stored, bf16)
PRECISIONS = {"bf16": None, "int8 slab": 8, "int4 slab": 4}

DESCRIPTION = (
    "Chooses the base diffusion transformer to train a LoRA on: a ComfyUI single file from "
    "models/diffusion_models (bf16, fp16 or fp8, including ComfyUI's fp8-mixed files) or a diffusers folder "
    "from models/diffusers. Every model family the pack knows (the family input lists them). "
    "It only reads the file header to check the model family and shapes; weights are loaded when training starts."
)


class LowVRAMLoadQuantizedSlab(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.families import families, family_ids

        return io.Schema(
            node_id="LowVRAMLoadQuantizedSlab", display_name="Load Quantized Slab", category=CATEGORY,
            description=DESCRIPTION, hidden=["unique_id"],
            outputs=[io.Output("LOWVRAM_MODEL", "model", "A handle to the checked checkpoint (family, variant, "
                                                        "location); nothing is on the GPU yet.")],
            inputs=[
                io.Combo("checkpoint", list_transformer_choices(),
                         tooltip="The base transformer: a .safetensors file from models/diffusion_models (or unet, "
                                 "checkpoints), or 'diffusers/<folder>' from models/diffusers."),
                io.Combo("family", ["auto"] + family_ids(), default="auto",
                         tooltip="Model family. 'auto' detects it from the tensor names; set it to get a clearer "
                                 "error when a file is not what you expect. "
                                 + " ".join(f"{f.id}: {f.file_help.get('checkpoint', f.display_name)}."
                                            for f in families().values())),
                io.Combo("precision", list(PRECISIONS), default="bf16",
                         tooltip="How the frozen base weights are held while training. bf16: 2 bytes per weight, "
                                 "exact. int8 slab: 1 byte per weight (per-row scales, ~0.9% weight error); half "
                                 "the host RAM and half the bytes streamed to the GPU. int4 slab: 0.56 byte per "
                                 "weight (groups of 64, ~8% weight error; a LoRA trained on it keeps >= 90% of "
                                 "the bf16 one's loss reduction, docs/int4.md); a quarter of bf16's RAM and "
                                 "bytes streamed. A slab is built once into models/slabs (progress shown) and "
                                 "reused afterwards."),
            ])

    @classmethod
    def fingerprint_inputs(cls, checkpoint, family="auto", precision="bf16", **_):
        # Re-check when the file on disk changes (ComfyUI otherwise caches by widget values).
        try:
            path = resolve_choice(checkpoint)
        except FileNotFoundError:
            return checkpoint
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files) + precision

    @classmethod
    def execute(cls, checkpoint: str, family: str = "auto", precision: str = "bf16") -> io.NodeOutput:
        from ..engine.config import ModelConfig
        from ..engine.models.inspect import inspect_transformer

        path = resolve_choice(checkpoint)
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        if PRECISIONS[precision] is not None:
            path = _ensure_slab(path, family, cls.hidden.unique_id, PRECISIONS[precision])
        info = inspect_transformer(ModelConfig(transformer_path=str(path), family=family, dtype="auto"))
        print(f"[lowvram-lora] {info.describe()}")
        return io.NodeOutput(info)


def _ensure_slab(checkpoint, family: str, unique_id, bits: int = 8):
    """Build the slab on first use (with progress), reuse it afterwards."""
    from ..engine.slab import ensure_slab
    from .progress import make_callback

    cb = make_callback(unique_id)
    return ensure_slab(checkpoint, slab_dir(), family=family, progress=False, bits=bits,
                       callback=lambda done, total: cb.on_progress(f"build int{bits} slab (MB)", done >> 20,
                                                                   total >> 20),
                       log=cb.log)
