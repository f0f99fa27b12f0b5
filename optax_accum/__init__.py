"""optax_accum: TF1-style gradient aggregation as composable Optax transforms.

Step-tagged accumulation that drops stale gradients, row-sparse accumulation,
cross-replica averaging with replica subgroups, stale-gradient dropping, and
communication-saving local SGD (AGN), for one CPU and for a TPU pod alike.
"""

import importlib
from typing import Any

from optax_accum.accumulator import ConditionalAccumulatorState, conditional_accumulator
from optax_accum.agn import AGNState, agn
from optax_accum.checkpoint import from_checkpoint, to_checkpoint
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

# Names that need Flax (the optional extra): imported on first use, so that
# `import optax_accum` works without Flax installed.
_NEED_FLAX = {
    "NNXOptimizer": "optax_accum.flax_train_state",
    "TrainState": "optax_accum.flax_train_state",
    "embedding_value_and_grad": "optax_accum.embedding",
}


def __getattr__(name: str) -> Any:
    module = _NEED_FLAX.get(name)
    if module is None:
        raise AttributeError(f"module 'optax_accum' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "flax":
            raise
        raise ImportError(
            f"optax_accum.{name} needs Flax, which is not installed; install the extra: "
            'pip install "optax-accum[flax]"'
        ) from e
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEED_FLAX))


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
]
