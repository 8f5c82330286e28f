"""Caption caching benchmark (issues 10, 38, 39): N captions through a text encoder: time, peak VRAM, host RAM.

The encoder runs layer-major from its memory map. By default Flux.2-dev's Mistral-Small-24B-shaped encoder, 512 tokens.

The GPU machine's disk (64 GB) holds a pruned 30-layer Mistral-24B in bf16 (34.7 GB, ComfyUI
ships such a file): this script writes one with random weights, one safetensors shard per layer,
in a diffusers-style folder (``text_encoder/`` with the real Mistral3 config of 40 layers, whose
layers 30-39 are absent from the files and must never be asked for; ``tokenizer/`` a word-level
tokenizer with Mistral's chat shape: captions are padded to 512 tokens either way, so the
compute is the real one). Then it times ``encode_stacked`` (what Cache Text Embeds runs for it), with
the files in the page cache (just written; ``--warm`` reads them once more first).

    source bench/gpu_env.sh
    python3 bench/bench_text_cache.py --workdir /tmp/mistral --captions 118 --out "$OUT/results.jsonl"

Issue 38's encoders: ``--family krea2`` (Qwen3-VL-4B, 35 layers, twelve taps), ``flux3`` (the same Qwen3-VL-4B file,
hidden states 4, 8, ..., 32, the window padded to a multiple of 80 and kept), ``flux2-klein-4b`` / ``flux2-klein-9b``
(Qwen3-4B / 8B, hidden states 9, 18, 27). ``--smoke --device cpu`` runs the same code on the encoder's architecture
shrunk to a tiny width (every layer kept, so the taps are the real ones): a check that the command works, not a
measurement (its row says ``smoke``).

Issue 39: ``--family ltx2.3``: LTX-2.3's Gemma-3-12B (all 48 layers, its 49 hidden states folded into the text
connectors as each layer runs) and the connectors (3.2B parameters, ``configs/connectors/ltx2.3.json``), every caption
left-padded to 1024 tokens; the row's ``embed_shape`` is the cached (1024, 4096 + 2048). On disk: Gemma 23.5 GB +
connectors 6.3 GB bf16 (30 GB; the GPU machine's disk is 64 GB, so not beside the 34.7 GB Mistral folder). ``--smoke``
shrinks Gemma to width 64 and the connectors to 64 + 32 (their 8 + 8 layers and 128 registers kept):

    python3 bench/bench_text_cache.py --family ltx2.3 --workdir /tmp/tc-ltx --captions 118 --out "$OUT/results.jsonl"

What is timed is the family's text-encoder kind's ``encode`` (``engine/caching/encoders/``), the call Cache Text
Embeds makes for each encoder (``caching/entries.build_text``). The random weights are written by a child process,
so the row's host RAM is the encode's: ``host_rss_gb`` the process's peak resident set (its imports included; the
memory-mapped encoder's pages count in it), ``host_unreclaimable_peak_gb`` the peak of anonymous + shared memory
(what the RAM planner counts, sampled every 20 ms), ``host_locked_peak_gb`` its page-locked part.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import GB, _command, _gpu_name, _versions, new_run_id, row_emitter  # noqa: E402
from bench_experts import HostSampler  # noqa: E402

# Mistral-Small-3.x 24B text part (comfy/text_encoders/llama.py Mistral3Small24BConfig; HF config).
MISTRAL_24B = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e9, rms_norm_eps=1e-5,
                   max_position_embeddings=131072)


#: ``--smoke``: the width an encoder is shrunk to (layers, vocabulary and the rest of the config kept).
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _shrunk(text_cfg: dict, smoke: bool) -> dict:
    return {**text_cfg, **SMOKE} if smoke else text_cfg


def write_encoder(root: Path, layers_on_disk: int, device, smoke: bool = False) -> Path:
    from safetensors.torch import save_file
    from transformers import Mistral3Config

    from lowvram_lora.engine.families.tiny import TINY_MISTRAL_CHAT_TEMPLATE
    from lowvram_lora.engine.families.tiny import word_level_tokenizer as _word_level_tokenizer

    enc = root / "text_encoder"
    enc.mkdir(parents=True, exist_ok=True)
    text = _shrunk(MISTRAL_24B, smoke)
    cfg = Mistral3Config(text_config={"model_type": "mistral", **text},
                         vision_config={"model_type": "pixtral"})
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    (enc / "config.json").write_text(cfg.to_json_string())
    tok, _ = _word_level_tokenizer(["<pad>", "<s>", "</s>", "[IMG]", "<unk>"], "<s>", "</s>", "<pad>", "<unk>", 512)
    tok.chat_template = TINY_MISTRAL_CHAT_TEMPLATE
    tok.padding_side = "left"
    tok.save_pretrained(root / "tokenizer")
    d, f = text["hidden_size"], text["intermediate_size"]
    heads, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * std).cpu()

    p = "model.language_model."
    save_file({f"{p}embed_tokens.weight": rnd(MISTRAL_24B["vocab_size"], d)}, str(enc / "embed.safetensors"))
    for i in range(layers_on_disk):
        q = f"{p}layers.{i}."
        save_file({
            q + "self_attn.q_proj.weight": rnd(heads, d), q + "self_attn.k_proj.weight": rnd(kv, d),
            q + "self_attn.v_proj.weight": rnd(kv, d), q + "self_attn.o_proj.weight": rnd(d, heads),
            q + "mlp.gate_proj.weight": rnd(f, d), q + "mlp.up_proj.weight": rnd(f, d),
            q + "mlp.down_proj.weight": rnd(d, f),
            q + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            q + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
        }, str(enc / f"layer-{i:02d}.safetensors"))
    return root


# Qwen2.5-VL-7B's language model (Qwen-Image's text encoder; the family's shipped config).
def write_qwen25_encoder(root: Path, layers: int, device, smoke: bool = False) -> Path:
    """A Qwen2.5-VL-7B-shaped text encoder with random weights, one shard per layer (diffusers folder layout,
    transformers 5 names), and a word-level tokenizer with Qwen's turn tokens."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.families import get_family, text_architecture_config
    from lowvram_lora.engine.families.qwen_image.fixtures import tiny_qwen25_tokenizer

    family = get_family("qwen_image")
    enc = root / "text_encoder"
    enc.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(text_architecture_config(family, "qwen2.5-vl-7b").read_text())
    if smoke:  # Qwen2.5's head width is hidden / heads (no head_dim key); its mrope sections span half of it
        cfg["text_config"] = {**cfg["text_config"], **{k: v for k, v in SMOKE.items() if k != "head_dim"}}
        rope = cfg["text_config"].get("rope_parameters") or {}
        if "mrope_section" in rope:
            cfg["text_config"]["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3]}
    (enc / "config.json").write_text(json.dumps(cfg))
    tok, _ = tiny_qwen25_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    t = cfg["text_config"]
    d, f, heads, kv = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    hd = d // heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * std).cpu()

    p = "model.language_model."
    save_file({f"{p}embed_tokens.weight": rnd(t["vocab_size"], d), f"{p}norm.weight": torch.ones(d, dtype=torch.bfloat16)},
              str(enc / "embed.safetensors"))
    for i in range(layers):
        q = f"{p}layers.{i}."
        save_file({
            q + "self_attn.q_proj.weight": rnd(heads * hd, d), q + "self_attn.q_proj.bias": rnd(heads * hd),
            q + "self_attn.k_proj.weight": rnd(kv * hd, d), q + "self_attn.k_proj.bias": rnd(kv * hd),
            q + "self_attn.v_proj.weight": rnd(kv * hd, d), q + "self_attn.v_proj.bias": rnd(kv * hd),
            q + "self_attn.o_proj.weight": rnd(d, heads * hd),
            q + "mlp.gate_proj.weight": rnd(f, d), q + "mlp.up_proj.weight": rnd(f, d), q + "mlp.down_proj.weight": rnd(d, f),
            q + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            q + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
        }, str(enc / f"layer-{i:02d}.safetensors"))
    return root



def decoder_layer(q: str, rnd, norm, d: int, f: int, heads: int, kv: int, hd: int, extra_norms=()) -> dict:
    """One decoder layer's tensors under prefix ``q`` (Qwen3's and Gemma 3's share these names: q/k/v/o with q/k norms,
    a gated MLP, the input and post-attention norms; ``extra_norms``: Gemma's feed-forward ones), ``rnd`` for the
    weights, ``norm`` for the norms (Qwen3 scales by the weight: ones; Gemma by 1 + weight: zeros)."""
    return {
        q + "self_attn.q_proj.weight": rnd(heads * hd, d), q + "self_attn.k_proj.weight": rnd(kv * hd, d),
        q + "self_attn.v_proj.weight": rnd(kv * hd, d), q + "self_attn.o_proj.weight": rnd(d, heads * hd),
        q + "self_attn.q_norm.weight": norm(hd), q + "self_attn.k_norm.weight": norm(hd),
        q + "mlp.gate_proj.weight": rnd(f, d), q + "mlp.up_proj.weight": rnd(f, d), q + "mlp.down_proj.weight": rnd(d, f),
        q + "input_layernorm.weight": norm(d), q + "post_attention_layernorm.weight": norm(d),
        **{f"{q}{name}.weight": norm(d) for name in extra_norms},
    }


# Qwen3-VL-4B's language model (Krea 2's and FLUX.3's text encoder; the family's shipped config), or Qwen3-4B / 8B
# (Flux.2 klein's; no vision tower, ``model.`` names).
def write_qwen3vl_encoder(root: Path, layers: int, device, smoke: bool = False, family_id: str = "krea2",
                          architecture: str = "qwen3-vl-4b") -> Path:
    """A Qwen3-VL-4B-shaped (or Qwen3-shaped: ``architecture``) text encoder with random weights (``layers`` of them
    on disk, one shard each; the config keeps them all), transformers 5's ``Qwen3VLModel`` (``Qwen3ForCausalLM``)
    names, and a word-level tokenizer with Qwen's turn tokens."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.families import get_family, text_architecture_config
    from lowvram_lora.engine.families.qwen_image.fixtures import tiny_qwen25_tokenizer

    family = get_family(family_id)
    enc = root / "text_encoder"
    enc.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(text_architecture_config(family, architecture).read_text())
    vl = "text_config" in cfg
    if vl:
        cfg["text_config"] = _shrunk(cfg["text_config"], smoke)
    else:
        cfg = _shrunk(cfg, smoke)
    (enc / "config.json").write_text(json.dumps(cfg))
    tok, _ = tiny_qwen25_tokenizer()
    if not vl:  # Qwen3 (Flux.2 klein): the pipeline applies the tokenizer's own chat template
        from lowvram_lora.engine.families.tiny import TINY_QWEN3_CHAT_TEMPLATE

        tok.chat_template = TINY_QWEN3_CHAT_TEMPLATE
    tok.save_pretrained(root / "tokenizer")
    t = cfg["text_config"] if vl else cfg
    d, f, heads, kv, hd = (t["hidden_size"], t["intermediate_size"], t["num_attention_heads"],
                           t["num_key_value_heads"], t["head_dim"])
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * std).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    p = "language_model." if vl else "model."
    save_file({f"{p}embed_tokens.weight": rnd(t["vocab_size"], d)}, str(enc / "embed.safetensors"))
    for i in range(layers):
        q = f"{p}layers.{i}."
        save_file(decoder_layer(q, rnd, ones, d, f, heads, kv, hd), str(enc / f"layer-{i:02d}.safetensors"))
    return root

#: ``--smoke``: LTX-2's text connectors at a width the smoke Gemma feeds (layers and registers kept; each modality's
#: width is its heads x head width, as in the real config).
SMOKE_CONNECTORS = dict(video_connector_num_attention_heads=4, video_connector_attention_head_dim=16,
                        video_hidden_dim=64, audio_connector_num_attention_heads=4,
                        audio_connector_attention_head_dim=8, audio_hidden_dim=32)


def write_gemma_connectors(root: Path, layers: int | None, device, smoke: bool = False, family_id: str = "ltx2",
                           variant: str = "ltx2.3") -> Path:
    """LTX-2's text path as the diffusers pipeline folder holds it, with random weights: ``text_encoder/`` a
    Gemma-3-12B (the family's shipped config, ``transformers`` 5's ``Gemma3ForConditionalGeneration`` names; its
    language model only, one shard per layer, all layers: ``layers`` is unused), ``tokenizer/`` a word-level tokenizer
    in Gemma's layout (left padding; captions are padded to 1024 tokens either way, so the compute is the real one),
    ``connectors/`` ``LTX2TextConnectors`` of the shipped config, saved by diffusers (``from_pretrained`` reads it)."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from safetensors.torch import save_file

    from lowvram_lora.engine.families import get_family, text_architecture_config
    from lowvram_lora.engine.families.ltx2.comfy_files import COMFY_TEXT, connectors_config
    from lowvram_lora.engine.families.ltx2.fixtures import tiny_gemma_tokenizer

    family = get_family(family_id)
    spec = family.text_encoder_specs(variant)[0]
    names = COMFY_TEXT[spec.architecture]
    enc = root / spec.subfolder
    enc.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(text_architecture_config(family, names.gemma).read_text())
    cfg["text_config"] = _shrunk(cfg["text_config"], smoke)
    t = cfg["text_config"]
    d, f, heads, kv, hd = (t["hidden_size"], t["intermediate_size"], t["num_attention_heads"],
                           t["num_key_value_heads"], t["head_dim"])
    tok, _ = tiny_gemma_tokenizer(spec.max_length)
    tok.save_pretrained(root / spec.tokenizer_subfolder)
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * std).cpu()

    def norm(n):  # Gemma's RMS norms scale by 1 + weight
        return torch.zeros(n, dtype=torch.bfloat16)

    p = "model.language_model."
    save_file({f"{p}embed_tokens.weight": rnd(t["vocab_size"], d), f"{p}norm.weight": norm(d)},
              str(enc / "embed.safetensors"))
    for i in range(t["num_hidden_layers"]):
        q = f"{p}layers.{i}."
        save_file(decoder_layer(q, rnd, norm, d, f, heads, kv, hd,
                                extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm")),
                  str(enc / f"layer-{i:02d}.safetensors"))
    conn = connectors_config(names.connectors)
    if smoke:
        conn = {**conn, **SMOKE_CONNECTORS}
    assert (conn["caption_channels"], conn["text_proj_in_factor"]) == (3840, t["num_hidden_layers"] + 1), conn
    conn["caption_channels"] = d
    torch.manual_seed(0)
    with torch.device(device):  # 3.2B parameters: initialised on the GPU, saved in bf16
        connectors = LTX2TextConnectors(**conn).to(torch.bfloat16)
    connectors.save_pretrained(root / "connectors", safe_serialization=True)
    # Written last: a folder with config.json is complete (main() skips writing it again).
    (enc / "config.json").write_text(json.dumps(cfg))
    return root


#: --family -> (family id, variant whose text encoder is timed, writer arguments, model name in the row).
ENCODERS = {
    "flux2": ("flux2", "flux2-dev", {}, "mistral-small-24b (30 of 40 layers on disk)"),
    "qwen_image": ("qwen_image", "qwen-image", {}, "qwen2.5-vl-7b (28 layers)"),
    "krea2": ("krea2", "krea2-raw", {}, "qwen3-vl-4b (35 of 36 layers, 12 taps)"),
    "flux3": ("flux3", "flux3-klein-base", {"family_id": "flux3"},
              "qwen3-vl-4b (32 of 36 layers, 8 taps, window padded to 80s)"),
    "flux2-klein-4b": ("flux2", "flux2-klein-4b", {"family_id": "flux2", "architecture": "qwen3-4b"},
                       "qwen3-4b (27 of 36 layers, 3 taps)"),
    "flux2-klein-9b": ("flux2", "flux2-klein-9b", {"family_id": "flux2", "architecture": "qwen3-8b"},
                       "qwen3-8b (27 of 36 layers, 3 taps)"),
    "ltx2.3": ("ltx2", "ltx2.3", {"family_id": "ltx2", "variant": "ltx2.3"},
               "gemma-3-12b (48 layers, 49 states) + ltx2.3 text connectors"),
}
#: What ``write`` wrote in a workdir (a folder of another --family or of the smoke width is never timed by mistake).
MARKER = "bench-encoder.json"
#: --family -> the function that writes its encoder (the rest: ``write_qwen3vl_encoder``).
WRITERS = {"flux2": write_encoder, "qwen_image": write_qwen25_encoder, "ltx2.3": write_gemma_connectors}


def write(family: str, root: Path, device: str, smoke: bool) -> None:
    """Write ``--family``'s encoder with random weights under ``root`` (run in a child process: the bench's host RAM
    figures are then the encode's alone)."""
    family_id, variant, writer_args, _ = ENCODERS[family]
    from lowvram_lora.engine.families import get_family

    spec = get_family(family_id).text_encoder_specs(variant)[0]
    t = time.perf_counter()
    WRITERS.get(family, write_qwen3vl_encoder)(root, max(spec.hidden_layers, default=0) or None,
                                               torch.device(device), smoke=smoke, **writer_args)
    (root / MARKER).write_text(json.dumps({"family": family, "smoke": smoke}))
    print(f"wrote {sum(f.stat().st_size for f in root.rglob('*.safetensors')) / GB:.1f} GB in "
          f"{time.perf_counter() - t:.0f} s", flush=True)


def main(argv=None) -> int:
    from lowvram_lora.engine.caching.encoders import encoder_kind
    from lowvram_lora.engine.families import get_family

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None,
                   help="where the random-weight encoder is written (kept for later runs); default /tmp/mistral24b "
                        "for flux2, else /tmp/text-cache-<family>[-smoke]")
    p.add_argument("--captions", type=int, default=118)
    p.add_argument("--max-length", type=int, default=0,
                   help="tokens at most (0: the encoder spec's, 512 for most; LTX-2 always pads to its 1024)")
    p.add_argument("--warm", action="store_true", help="read the files once before timing")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    p.add_argument("--family", default="flux2", choices=list(ENCODERS),
                   help="flux2: Flux.2-dev's Mistral-24B (30 layers); qwen_image: Qwen-Image's Qwen2.5-VL-7B (all 28 "
                        "layers + the final norm, variable length); krea2: Krea 2's Qwen3-VL-4B (35 layers, twelve "
                        "taps stacked, variable length); flux3: FLUX.3 Klein's Qwen3-VL-4B (layers to 32, windowed); "
                        "flux2-klein-4b / -9b: Flux.2 klein's Qwen3-4B / 8B; ltx2.3: LTX-2.3's Gemma-3-12B (48 "
                        "layers, all 49 states) + its text connectors, left-padded to 1024 tokens")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (with --smoke)")
    p.add_argument("--smoke", action="store_true", help="the encoder shrunk to a tiny width: checks the command runs")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        p.error("--device cpu times nothing worth a row at full size; add --smoke (a check that the command runs)")
    root = Path(args.workdir or ("/tmp/mistral24b" if args.family == "flux2" and not args.smoke else
                                 f"/tmp/text-cache-{args.family}" + ("-smoke" if args.smoke else "")))
    if (root / MARKER).exists():
        held = json.loads((root / MARKER).read_text())
        if held != {"family": args.family, "smoke": args.smoke}:
            p.error(f"--workdir {root} holds the encoder of --family {held['family']}"
                    f"{' --smoke' if held['smoke'] else ''}; give another --workdir (or delete that folder)")
    family_id, variant, _, model_name = ENCODERS[args.family]
    family = get_family(family_id)
    spec = family.text_encoder_specs(variant)[0]
    kind = encoder_kind(spec.kind)
    if args.smoke:
        model_name += " [smoke: width 64]"
    if not (root / spec.subfolder / "config.json").exists():
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=write,
                                                             args=(args.family, root, str(device), args.smoke))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"writing the random-weight encoder under {root} failed (exit code {child.exitcode})")
    if args.warm:
        for f in sorted((root / "text_encoder").glob("*.safetensors")):
            with f.open("rb") as h:
                while h.read(1 << 26):
                    pass
    words = ["a", "photo", "of", "ohwx", "red", "dog", "on", "the", "left", "with", "big", "bright", "background"]
    # Flux.2: padded to 512 either way; the others: each caption at its own length (or window), 40-199 words.
    span = (8, 20) if family_id == "flux2" else (40, 160)
    captions = [" ".join(words[(i + j) % len(words)] for j in range(span[0] + (i * 37) % span[1]))
                for i in range(args.captions)]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    max_length = kind.caption_length(spec, args.max_length or spec.max_length)
    host = HostSampler()
    t = time.perf_counter()
    # What Cache Text Embeds runs for each of the family's encoders (caching/entries.build_text).
    out = kind.encode(root, None, family, spec, captions, device, torch.bfloat16, max_length)
    if cuda:
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t
    ram = host.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    emit = row_emitter(Path(args.out), {"run_id": new_run_id(), "gpu": _gpu_name(device), **_versions()})
    emit({"model": model_name, "family": args.family, "variant": variant,
          "mode": "text-cache-layer-major" + ("-smoke" if args.smoke else ""), "res": None, "step_s": None,
          "captions": args.captions, "max_length": max_length, "wall_s": round(wall, 2),
          "peak_alloc_gb": round(torch.cuda.max_memory_allocated(device) / GB, 3) if cuda else None,
          "peak_reserved_gb": round(torch.cuda.max_memory_reserved(device) / GB, 3) if cuda else None,
          # host_ram_gb / pinned_gb: the names every bench row uses (RssAnon + RssShmem at its peak; page-locked).
          "host_ram_gb": ram["host_peak_gb"], "pinned_gb": ram["host_locked_peak_gb"],
          "host_rss_gb": round(_rss_gb(), 2), "host_unreclaimable_peak_gb": ram["host_peak_gb"],
          "host_locked_peak_gb": ram["host_locked_peak_gb"],
          "embed_shape": list(out[0].shape), "embed_finite": all(bool(o.isfinite().all()) for o in out),
          "command": _command(), "note": args.note})
    return 0


def _rss_gb() -> float:
    """This process's peak resident host memory (ru_maxrss, KiB on Linux), in GB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


if __name__ == "__main__":
    raise SystemExit(main())
