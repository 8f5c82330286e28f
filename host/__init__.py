"""Runs our graphs without ComfyUI (the executor behind ``lowvram-lora run``)."""
