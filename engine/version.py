"""The tool version, written into every LoRA file's metadata."""
VERSION = "0.1.0"
