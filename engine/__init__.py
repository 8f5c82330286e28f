"""The training engine: pure Python + torch; never imports ComfyUI."""
