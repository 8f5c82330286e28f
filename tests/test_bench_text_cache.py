"""bench/bench_text_cache.py's CPU smoke for LTX-2.3 (issue 39): the bench writes Gemma-3-12B (all 48 layers, width
64) and LTX-2.3's text connectors (shrunk, layers and registers kept) in the pipeline folder layout and runs the caching
encode Cache Text Embeds runs on them. Its row's embed shape is the family spec's: every caption left-padded to 1024
rows, the video connector's width then the audio one's (at full size (1024, 4096 + 2048), the transformer's
cross-attention widths)."""
from __future__ import annotations

import json

import torch
from helpers import bench_module



def test_the_ltx23_text_cache_bench_smoke_gives_the_family_specs_rows(tmp_path):
    from lowvram_lora.engine.families.ltx2 import FAMILY
    from lowvram_lora.engine.families.ltx2.comfy_files import connectors_config
    from lowvram_lora.engine.families.ltx2.text import PROMPT_KEY

    spec = FAMILY.text_encoder_specs("ltx2.3")[0]
    full = connectors_config("ltx2.3")  # what the bench writes at full size
    assert (spec.max_length, full["video_hidden_dim"] + full["audio_hidden_dim"]) == (
        1024, FAMILY.text_widths(FAMILY.load_config("ltx2.3"))[PROMPT_KEY]) == (1024, 4096 + 2048)

    out, work = tmp_path / "rows.jsonl", tmp_path / "work"
    bench = bench_module("bench_text_cache")
    # The random-weight folder is written here, not in the child process the command starts (its imports would cost
    # seconds); the rest is the command's own code. One thread: 1024-token captions through 48 tiny layers are many
    # small ops, slow when two threads share busy cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.write("ltx2.3", work, "cpu", True)
        assert bench.main(["--family", "ltx2.3", "--smoke", "--device", "cpu", "--captions", "2", "--workdir",
                           str(work), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    [row] = map(json.loads, out.read_text().splitlines())
    written = json.loads((work / "connectors" / "config.json").read_text())
    gemma = json.loads((work / "text_encoder" / "config.json").read_text())["text_config"]
    assert (gemma["num_hidden_layers"], written["text_proj_in_factor"], written["caption_channels"]) == (48, 49, 64)
    assert row["embed_shape"] == [spec.max_length, written["video_hidden_dim"] + written["audio_hidden_dim"]] == [
        1024, 96]
    assert row["embed_finite"] is True and row["captions"] == 2 and row["max_length"] == 1024
    assert row["mode"] == "text-cache-layer-major-smoke" and row["family"] == "ltx2.3" and row["wall_s"] > 0
    assert row["host_rss_gb"] > 0.1 and row["host_unreclaimable_peak_gb"] > 0.1 and row["peak_alloc_gb"] is None
