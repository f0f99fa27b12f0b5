"""optax_accum: TF1-style gradient aggregation as composable Optax transforms.

Step-tagged accumulation that drops stale gradients, row-sparse accumulation,
cross-replica averaging with replica subgroups, stale-gradient dropping, and
communication-saving local SGD (AGN), for one CPU and for a TPU pod alike.
"""

from optax_accum.accumulator import ConditionalAccumulatorState, conditional_accumulator
from optax_accum.agn import AGNState, agn
from optax_accum.cross_shard import cross_shard, cross_shard_optimizer
from optax_accum.embedding import embedding_value_and_grad
from optax_accum.flax_train_state import NNXOptimizer, TrainState
from optax_accum.host import ConditionalAccumulator, SparseConditionalAccumulator
from optax_accum.indexed_slices import IndexedSlices, apply_updates, densify
from optax_accum.sharding import replica_group_mesh, state_partition_specs
from optax_accum.sparse import (
    SparseConditionalAccumulatorState,
    sparse_conditional_accumulator,
    sparse_sgd,
)
from optax_accum.staleness import (
    DropStaleGradientsState,
    drop_stale_gradients,
    staleness_percentage,
)
from optax_accum.state import global_step, has_updated, num_accumulated, set_global_step
from optax_accum.train_step import apply_gradients

__version__ = "0.1.0"

__all__ = [
    "AGNState",
    "ConditionalAccumulator",
    "ConditionalAccumulatorState",
    "DropStaleGradientsState",
    "IndexedSlices",
    "NNXOptimizer",
    "SparseConditionalAccumulator",
    "SparseConditionalAccumulatorState",
    "TrainState",
    "agn",
    "apply_gradients",
    "apply_updates",
    "conditional_accumulator",
    "cross_shard",
    "cross_shard_optimizer",
    "densify",
    "drop_stale_gradients",
    "embedding_value_and_grad",
    "global_step",
    "has_updated",
    "num_accumulated",
    "replica_group_mesh",
    "set_global_step",
    "sparse_conditional_accumulator",
    "sparse_sgd",
    "staleness_percentage",
    "state_partition_specs",
]
