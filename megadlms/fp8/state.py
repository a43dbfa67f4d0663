"""`fp8_autocast` and `FP8GlobalStateManager`: where FP8 is on, with which recipe.

As in Transformer Engine, FP8 modules run their FP8 path only inside an enabled `fp8_autocast`;
outside it they are plain high-precision layers. The state is process-global (not per thread),
scoped by the context manager and restored on exit, exceptions included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from .recipe import DelayedScaling, Recipe, check_recipe


@dataclass(frozen=True)
class FP8State:
    enabled: bool = False
    recipe: Recipe | None = None  # None: not given (modules use their own; get_fp8_recipe() gives the default)
    amax_reduction_group: Any = None
    # inside a checkpointed forward (recomputing=False) or its recomputation (True): the FP8 weights cast in the one
    # for the other to reuse
    checkpoint_weights: CheckpointWeights | None = None
    recomputing: bool = False


class FP8GlobalStateManager:
    """The FP8 scope of the process (Transformer Engine's name). Use the classmethods; no instances."""

    _state: FP8State = FP8State()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """True inside an enabled `fp8_autocast` (e.g. during a converted model's transformer layers)."""
        return cls._state.enabled

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The recipe of the innermost `fp8_autocast`; DelayedScaling() when it was given none (as TE)."""
        return cls._state.recipe if cls._state.recipe is not None else DelayedScaling()

    @classmethod
    def get_explicit_recipe(cls) -> Recipe | None:
        """The recipe passed to the innermost `fp8_autocast`, or None when none was passed."""
        return cls._state.recipe

    @classmethod
    def get_amax_reduction_group(cls) -> Any:
        """The process group given to the innermost `fp8_autocast` (or an outer one), else None."""
        return cls._state.amax_reduction_group

    @classmethod
    def get_state(cls) -> FP8State:
        return cls._state

    @classmethod
    def set_state(cls, state: FP8State) -> None:
        cls._state = state

    @classmethod
    def is_fp8_available(cls, device: Any = None) -> tuple[bool, str]:
        """(available, reason) for `device` (default: the current CUDA device, else CPU)."""
        from .hardware import FP8UnsupportedError, check_fp8_support, default_device

        try:
            check_fp8_support(default_device() if device is None else device)
        except FP8UnsupportedError as e:
            return False, str(e)
        return True, ""


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None,
                 amax_reduction_group: Any = None) -> Iterator[None]:
    """Run FP8 modules in FP8 (enabled=True) or in high precision (enabled=False) inside the block.

    fp8_recipe: the recipe in force; an FP8 module uses the recipe it was converted with and raises
        if an explicitly given, different recipe is in force (no silent mixing of scaling schemes).
    amax_reduction_group: the process group over which `fp8_step` reduces amaxes when it is given
        none; inherited from an enclosing `fp8_autocast` when None.
    Nestable; the previous state is restored on exit, also when the block raises.
    """
    if fp8_recipe is not None:
        check_recipe(fp8_recipe)
    prev = FP8GlobalStateManager._state
    group = amax_reduction_group if amax_reduction_group is not None else prev.amax_reduction_group
    FP8GlobalStateManager._state = replace(prev, enabled=bool(enabled), recipe=fp8_recipe, amax_reduction_group=group)
    try:
        yield
    finally:
        FP8GlobalStateManager._state = prev


@contextlib.contextmanager
def _restored(state: FP8State) -> Iterator[None]:
    prev = FP8GlobalStateManager._state
    FP8GlobalStateManager._state = state
    try:
        yield
    finally:
        FP8GlobalStateManager._state = prev


class CheckpointWeights:
    """The FP8 weights that the layers of one checkpointed forward cast, by layer, for the recomputation of that
    forward to take instead of casting them again. A layer without a per-step weight cache (one micro-batch per step)
    would otherwise cast each weight twice per step; the forward's autograd graph holds these weights until the
    backward anyway, and the recomputation takes each out, so keeping them here costs no memory."""

    def __init__(self) -> None:
        self._casts: dict[int, Any] = {}

    def keep(self, module: Any, cast: Any) -> None:
        self._casts[id(module)] = cast

    def take(self, module: Any, key: Any) -> Any:
        """The cast `module` kept in the forward when it was made from the weight version `key`, else None."""
        cast = self._casts.pop(id(module), None)
        return cast if cast is not None and key is not None and cast.key == key else None


def keep_for_recompute(module: Any, cast: Any) -> None:
    """Inside a checkpointed forward: keep `module`'s FP8 weight cast (an `FP8WeightCache`) for its recomputation."""
    weights = FP8GlobalStateManager._state.checkpoint_weights
    if weights is not None and not FP8GlobalStateManager._state.recomputing:
        weights.keep(module, cast)


def cast_from_forward(module: Any, key: Any) -> Any:
    """Inside a recomputation: the FP8 weight cast `module` made in the checkpointed forward from the same weight
    version `key` (`keep_for_recompute`), or None (cast it)."""
    state = FP8GlobalStateManager._state
    if state.checkpoint_weights is None or not state.recomputing:
        return None
    return state.checkpoint_weights.take(module, key)


def fp8_checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`.

    Activation checkpointing recomputes a layer's forward during backward, i.e. outside the
    `fp8_autocast` of the original forward. This captures the FP8 state at forward time and
    re-enters it for the recomputation, so the recomputed forward takes the same FP8 path, with the
    FP8 weights the forward cast (`CheckpointWeights`) instead of casting them again.
    """
    weights = CheckpointWeights()
    state = FP8GlobalStateManager._state
    return (_restored(replace(state, checkpoint_weights=weights)),
            _restored(replace(state, checkpoint_weights=weights, recomputing=True)))
