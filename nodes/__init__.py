"""ComfyUI node classes (classic style). Populated by the nodes issue; empty until then."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
