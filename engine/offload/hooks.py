"""One way to intercept a module's forward, with exact undo: named hooks on one registry per module.

In the style of diffusers' ``hooks/hooks.py``: a ``ModelHook`` has ``pre_forward`` (may replace the
arguments) and ``post_forward`` (may replace the output); a ``HookRegistry`` kept on one module
attribute holds a module's hooks by name, refuses a name twice (applying a feature twice is a bug,
not a no-op), and ``remove(name)`` takes one out; when the last goes, the registry leaves the module
exactly as it was (no torch hook, no attribute).

Unlike diffusers, the registry does not replace ``module.forward``: it dispatches from torch's own
forward pre-hook and forward hook, which ``nn.Module.__call__`` runs around ``forward``. That keeps
our hooks eager when a block's ``forward`` is compiled (engine/train/compile.py replaces ``forward``
only), and it keeps their timing: pre-hooks fire in the forward pass and again when gradient
checkpointing recomputes the block in backward, which is when block streaming needs them.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

#: The module attribute the registry lives on.
ATTRIBUTE = "_lowvram_hook_registry"


class ModelHook:
    """One interception of a module's forward. Override what you need; the defaults pass through."""

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def reset_state(self, module: nn.Module) -> None:
        """Forget per-run state (nothing by default)."""


def _overrides(hook: ModelHook, method: str) -> bool:
    return getattr(type(hook), method) is not getattr(ModelHook, method)


class HookRegistry:
    """A module's named hooks, run in the order they were registered (pre) and in reverse (post)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.hooks: dict[str, ModelHook] = {}
        self._pre_handle = None  # torch's RemovableHandle of the dispatching pre-hook, while one is needed
        self._post_handle = None

    @classmethod
    def of(cls, module: nn.Module) -> "HookRegistry":
        """The module's registry, made (and kept on the module) on first use."""
        registry = module.__dict__.get(ATTRIBUTE)
        if registry is None:
            registry = cls(module)
            module.__dict__[ATTRIBUTE] = registry  # a plain attribute: not a submodule, not in state_dict
        return registry

    @staticmethod
    def find(module: nn.Module) -> Optional["HookRegistry"]:
        return module.__dict__.get(ATTRIBUTE)

    def register(self, name: str, hook: ModelHook) -> None:
        if name in self.hooks:
            raise ValueError(f"{type(self.module).__name__} already has a hook named {name!r}: remove it before "
                             f"applying it again (was the earlier handle's remove() skipped?)")
        self.hooks[name] = hook
        if _overrides(hook, "pre_forward") and self._pre_handle is None:
            self._pre_handle = self.module.register_forward_pre_hook(self._run_pre, with_kwargs=True)
        if _overrides(hook, "post_forward") and self._post_handle is None:
            self._post_handle = self.module.register_forward_hook(self._run_post)

    def get(self, name: str) -> Optional[ModelHook]:
        return self.hooks.get(name)

    def remove(self, name: str) -> None:
        """Take the hook out; with the last one, the torch hooks and the registry itself go too."""
        if self.hooks.pop(name, None) is None:
            raise KeyError(f"{type(self.module).__name__} has no hook named {name!r}")
        if self._pre_handle is not None and not any(_overrides(h, "pre_forward") for h in self.hooks.values()):
            self._pre_handle.remove()
            self._pre_handle = None
        if self._post_handle is not None and not any(_overrides(h, "post_forward") for h in self.hooks.values()):
            self._post_handle.remove()
            self._post_handle = None
        if not self.hooks and self.module.__dict__.get(ATTRIBUTE) is self:
            del self.module.__dict__[ATTRIBUTE]

    def _run_pre(self, module, args, kwargs):
        for hook in list(self.hooks.values()):
            args, kwargs = hook.pre_forward(module, args, kwargs)
        return args, kwargs

    def _run_post(self, module, args, output):
        for hook in reversed(list(self.hooks.values())):
            output = hook.post_forward(module, output)
        return output
