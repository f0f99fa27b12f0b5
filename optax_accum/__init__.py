"""optax_accum: TF1-style gradient aggregation as composable Optax transforms.

Step-tagged accumulation that drops stale gradients, row-sparse accumulation,
cross-replica averaging with replica subgroups, stale-gradient dropping, and
communication-saving local SGD (AGN), for one CPU and for a TPU pod alike.
"""

import copyreg
import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and editors
    from optax_accum.accumulator import ConditionalAccumulatorState, conditional_accumulator
    from optax_accum.agn import AGNState, agn
    from optax_accum.checkpoint import from_checkpoint, to_checkpoint, upgrade_checkpoint
    from optax_accum.cross_shard import cross_shard, cross_shard_optimizer
    from optax_accum.host import ConditionalAccumulator, SparseConditionalAccumulator
    from optax_accum.indexed_slices import IndexedSlices, apply_updates, densify, sparse_sgd
    from optax_accum.recorded_norm import (
        RecordGlobalNormState,
        record_global_norm,
        recorded_global_norm,
    )
    from optax_accum.sharding import replica_group_mesh, state_partition_specs, state_shardings
    from optax_accum.sparse import (
        DenseRows,
        RowBuffer,
        SparseConditionalAccumulatorState,
        sparse_conditional_accumulator,
    )
    from optax_accum.staleness import (
        DropStaleGradientsState,
        drop_stale_gradients,
        staleness_percentage,
    )
    from optax_accum.state import (
        accumulated,
        global_step,
        has_updated,
        num_accumulated,
        set_global_step,
    )
    from optax_accum.train_step import apply_gradients
    from optax_accum.unreduced import (
        as_reduced,
        keep_reduction_axes,
        unreduced_grad,
        unreduced_value_and_grad,
    )

__version__ = "0.1.0"

# Every public name is imported on first use (PEP 562), from the module that defines
# it: `import optax_accum` imports no JAX, so a process that needs only NumPy pieces
# (the Ray actor of `optax_accum.ray`, which runs the host accumulators' core) does
# not pay for it. A name added to `__all__` is added here, and under TYPE_CHECKING.
_LAZY = {
    "optax_accum.accumulator": ("ConditionalAccumulatorState", "conditional_accumulator"),
    "optax_accum.agn": ("AGNState", "agn"),
    "optax_accum.checkpoint": ("from_checkpoint", "to_checkpoint", "upgrade_checkpoint"),
    "optax_accum.cross_shard": ("cross_shard", "cross_shard_optimizer"),
    "optax_accum.host": ("ConditionalAccumulator", "SparseConditionalAccumulator"),
    "optax_accum.indexed_slices": ("IndexedSlices", "apply_updates", "densify", "sparse_sgd"),
    "optax_accum.recorded_norm": (
        "RecordGlobalNormState",
        "record_global_norm",
        "recorded_global_norm",
    ),
    "optax_accum.sharding": ("replica_group_mesh", "state_partition_specs", "state_shardings"),
    "optax_accum.sparse": (
        "DenseRows",
        "RowBuffer",
        "SparseConditionalAccumulatorState",
        "sparse_conditional_accumulator",
    ),
    "optax_accum.staleness": (
        "DropStaleGradientsState",
        "drop_stale_gradients",
        "staleness_percentage",
    ),
    "optax_accum.state": (
        "accumulated",
        "global_step",
        "has_updated",
        "num_accumulated",
        "set_global_step",
    ),
    "optax_accum.train_step": ("apply_gradients",),
    "optax_accum.unreduced": (
        "as_reduced",
        "keep_reduction_axes",
        "unreduced_grad",
        "unreduced_value_and_grad",
    ),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

# Names that need Flax (the optional extra): `import optax_accum` works without Flax.
_NEED_FLAX = {
    "NNXOptimizer": "optax_accum.flax_train_state",
    "TrainState": "optax_accum.flax_train_state",
    "embedding_value_and_grad": "optax_accum.embedding",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name) or _NEED_FLAX.get(name)
    if module is None:  # a submodule (`optax_accum.host`), imported on first use too
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'optax_accum' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if name not in _NEED_FLAX or e.name is None or e.name.split(".")[0] != "flax":
            raise
        raise ImportError(
            f"optax_accum.{name} needs Flax, which is not installed; install the extra: "
            'pip install "optax-accum[flax]"'
        ) from e
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF) | set(_NEED_FLAX))


class _Package(types.ModuleType):
    """The package module. Python sets a submodule as an attribute of its package once
    it is loaded; where a public name is also its module's (`agn`, `cross_shard`), the
    public name is kept instead, as when every name was imported at once."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _MODULE_OF.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
# Pickled by name, as cloudpickle pickles an importable module (Ray sends a function
# that reads `optax_accum.` this way); its table of module types knows no subclass.
copyreg.pickle(_Package, lambda package: (importlib.import_module, (package.__name__,)))


__all__ = [
    "AGNState",
    "ConditionalAccumulator",
    "ConditionalAccumulatorState",
    "DenseRows",
    "DropStaleGradientsState",
    "IndexedSlices",
    "NNXOptimizer",
    "RecordGlobalNormState",
    "RowBuffer",
    "SparseConditionalAccumulator",
    "SparseConditionalAccumulatorState",
    "TrainState",
    "accumulated",
    "agn",
    "apply_gradients",
    "apply_updates",
    "as_reduced",
    "conditional_accumulator",
    "cross_shard",
    "cross_shard_optimizer",
    "densify",
    "drop_stale_gradients",
    "embedding_value_and_grad",
    "from_checkpoint",
    "global_step",
    "has_updated",
    "keep_reduction_axes",
    "num_accumulated",
    "record_global_norm",
    "recorded_global_norm",
    "replica_group_mesh",
    "set_global_step",
    "sparse_conditional_accumulator",
    "sparse_sgd",
    "staleness_percentage",
    "state_partition_specs",
    "state_shardings",
    "to_checkpoint",
    "unreduced_grad",
    "unreduced_value_and_grad",
    "upgrade_checkpoint",
]
