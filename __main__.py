"""``python -m lowvram_lora ...`` is the same as the ``lowvram-lora`` command."""

from .cli import main

raise SystemExit(main())
