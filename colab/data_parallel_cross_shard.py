# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: data_parallel_cross_shard.ipynb
#     provenance: []
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Data-parallel training with cross-shard averaging and replica groups
#
# On Colab: File > Upload notebook, and give the first cell optax_accum as it says.
# It runs on a TPU runtime (all its cores, or one chip), a GPU runtime (one device)
# or a CPU runtime (simulated devices).
#
# `tf.tpu.CrossShardOptimizer` averaged gradients across TPU cores before applying
# them, optionally within replica subgroups (`group_assignment`). In optax_accum that
# is `cross_shard_optimizer(inner, axis_name, group_assignment=...)` (or the
# chainable `cross_shard`), and it runs under `jax.pmap` and `jax.shard_map` alike.
#
# We train an MLP on digits with one batch shard per device, check that it matches
# single-device training on the whole batch, and then split the devices into two
# replica groups that train two models at once: an ensemble for the price of one job.

# %%
# Setup: run this cell first. On Colab it installs optax_accum, keeping the runtime's
# own jax (its TPU or GPU build). The notebook then uses the devices JAX finds: a TPU's
# cores, a GPU, or, on a CPU-only runtime, simulated CPU devices (8 by default; set
# OPTAX_ACCUM_CPU_DEVICES to change it). Device flags only take effect before JAX starts.
import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

REPOSITORY = None  # pyproject.toml's [project.urls] Repository; None: from an upload
MIN_JAX = "0.8.0"  # the oldest jax optax_accum supports (pyproject.toml)


def install_optax_accum():
    have = importlib.metadata.version("jax")
    if tuple(map(int, have.split(".")[:3])) < tuple(map(int, MIN_JAX.split("."))):
        raise RuntimeError(f"optax_accum needs jax>={MIN_JAX}; this runtime has jax {have}")
    wheels = sorted(glob.glob("/content/optax_accum-*.whl"))
    if REPOSITORY:
        source = f"optax-accum @ git+{REPOSITORY}"
    elif wheels:
        source = wheels[-1]
    elif os.path.exists("/content/optax_accum/pyproject.toml"):
        source = "/content/optax_accum"
    else:
        raise RuntimeError(
            "optax_accum is not installed. Build a wheel in a clone of the repository "
            "(`pip wheel --no-deps . -w dist`), upload dist/optax_accum-*.whl to /content "
            "(the Files pane), or upload the clone as /content/optax_accum; then run this "
            "cell again."
        )
    keep = "/tmp/keep_runtime_jax.txt"  # pip may not replace the runtime's jax
    with open(keep, "w") as f:
        for dist in ("jax", "jaxlib"):
            f.write(f"{dist}=={importlib.metadata.version(dist)}\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", keep]
    subprocess.run([*pip, source], check=True)
    # The demo's libraries: Colab has them; install only what is missing.
    wanted = {"flax": "flax", "sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}
    missing = [dist for mod, dist in wanted.items() if importlib.util.find_spec(mod) is None]
    if missing:
        subprocess.run([*pip, *missing], check=True)


if "google.colab" in sys.modules and importlib.util.find_spec("optax_accum") is None:
    install_optax_accum()

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    cpu_devices = int(os.environ.get("OPTAX_ACCUM_CPU_DEVICES", "8"))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}"

import jax

n = jax.device_count()
platform = jax.devices()[0].platform.upper()
print(f"{n} {platform} device{'s' if n > 1 else ''}, jax {jax.__version__}")

# %% tags=["parameters"]
STEPS = 200
PER_DEVICE_BATCH = 16
LR = 0.5

# %%
# The data: scikit-learn's bundled 8x8 digits (1797 images, no download), scaled to
# [0, 1] and split 80/20, the same as `python -m optax_accum.demo` trains on.
import numpy as np

from optax_accum.demo import notebook

x_train, y_train, x_test, y_test = notebook.digits()
sample = notebook.sampler(x_train, y_train)  # sample(rng, size): a random batch
print("train", x_train.shape, "test", x_test.shape)

# %%
# The model: an MLP (64 -> 64 -> 10) in Flax linen, its loss `loss_fn(params, xb, yb)`
# and its test accuracy `accuracy(params)` (jitted), from the same module.
model, init_params, loss_fn, accuracy = notebook.mlp(x_test, y_test)

# %%
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

import optax_accum

n = jax.device_count()
rng = np.random.default_rng(0)
batches = [sample(rng, n * PER_DEVICE_BATCH) for _ in range(STEPS)]


def shards(xb, yb):  # (n * B, ...) -> (n, B, ...): one slice per device
    return xb.reshape(n, PER_DEVICE_BATCH, -1), yb.reshape(n, PER_DEVICE_BATCH)


def replicate(tree):
    return jax.tree.map(lambda a: jnp.stack([a] * n), tree)


def replica(tree, r):  # replica r's slice of a stacked tree
    return jax.tree.map(lambda a: a[r], tree)


def largest_difference(tree_a, tree_b):  # in NumPy: the trees may live on different meshes
    pairs = zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True)
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs)


# %% [markdown]
# ## `jax.pmap`: every device averages with all the others

# %%
tx = optax_accum.cross_shard_optimizer(optax.sgd(LR), axis_name="devices")


def train_step(params, state, xb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
    updates, state = tx.update(grads, state, params)  # pmean over "devices"
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "devices")


p_step = jax.pmap(train_step, axis_name="devices")
params, state = replicate(init_params), replicate(tx.init(init_params))
pmap_loss = []
for xb, yb in tqdm(batches, desc="pmap"):
    params, state, loss = jax.block_until_ready(p_step(params, state, *shards(xb, yb)))
    pmap_loss.append(float(loss[0]))
pmap_params = replica(params, 0)
print("pmap accuracy", float(accuracy(pmap_params)))

# %%
# The same steps on one device, on the whole global batch.
sgd = optax.sgd(LR)


@jax.jit
def single_step(params, state, xb, yb):
    updates, state = sgd.update(jax.grad(loss_fn)(params, xb, yb), state, params)
    return optax.apply_updates(params, updates), state


params, state = init_params, sgd.init(init_params)
for xb, yb in tqdm(batches, desc="one device"):
    params, state = single_step(params, state, xb, yb)
diff = largest_difference(params, pmap_params)
print(f"largest difference from single-device training: {diff:.2e}")

# %% [markdown]
# ## `jax.shard_map`: the same step over a device mesh
#
# Under `shard_map` each device's gradient must be its own (varying over the
# axis), so we differentiate with respect to `jax.lax.pcast(params, ...,
# to="varying")`; `cross_shard` then averages it, and the result is replicated.

# %%
mesh = jax.make_mesh((n,), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))


def sm_step(params, state, xb, yb):
    local = jax.lax.pcast(params, "devices", to="varying")
    grads = jax.grad(loss_fn)(local, xb[0], yb[0])
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


sm_step = jax.jit(
    jax.shard_map(
        sm_step,
        mesh=mesh,
        in_specs=(P(), P(), P("devices"), P("devices")),
        out_specs=(P(), P()),
    )
)
params, state = init_params, tx.init(init_params)
for xb, yb in tqdm(batches, desc="shard_map"):
    # One step in flight at a time: on a few oversubscribed CPU cores, many
    # queued steps of 8 simulated devices can stall XLA:CPU's collectives.
    params, state = jax.block_until_ready(sm_step(params, state, *shards(xb, yb)))
diff = largest_difference(params, pmap_params)
print(f"shard_map accuracy {float(accuracy(params)):.3f}; differs from pmap by {diff:.2e}")

# %% [markdown]
# ## Replica groups: two models in one job
#
# With `group_assignment=[[0, 2, 4, 6], [1, 3, 5, 7]]`, each device averages
# only with its group. Starting the two groups from different initialisations
# trains two independent models; averaging their logits gives a small ensemble.
# Two groups need an even number of replicas: with one device (a GPU, or a single
# TPU chip), 8 replicas run on it under `jax.vmap`, which takes the same
# `axis_name` and groups as `jax.pmap`.

# %%
R = n if n % 2 == 0 else 8  # replicas: one per device, or 8 on one device
replica_map = (
    jax.pmap if n == R else (lambda f, axis_name=None: jax.jit(jax.vmap(f, axis_name=axis_name)))
)
groups = [list(range(0, R, 2)), list(range(1, R, 2))]
print(f"{R} replicas ({'one per device' if n == R else 'under jax.vmap'}), groups {groups}")
gtx = optax_accum.cross_shard_optimizer(optax.sgd(LR), axis_name="devices", group_assignment=groups)
second = model.init(jax.random.key(1), jnp.zeros((1, 64)))["params"]
params = jax.tree.map(  # replica r starts from model r % 2
    lambda a, b: jnp.stack([a if r % 2 == 0 else b for r in range(R)]),
    init_params,
    second,
)
state = replica_map(gtx.init)(params)
group_batches = [sample(rng, R * PER_DEVICE_BATCH) for _ in range(STEPS)]


def group_shards(xb, yb):  # one slice per replica
    return xb.reshape(R, PER_DEVICE_BATCH, -1), yb.reshape(R, PER_DEVICE_BATCH)


def group_step(params, state, xb, yb):
    grads = jax.grad(loss_fn)(params, xb, yb)
    updates, state = gtx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


g_step = replica_map(group_step, axis_name="devices")
group_acc = {0: [], 1: []}
for i, (xb, yb) in enumerate(tqdm(group_batches, desc="two groups")):
    params, state = jax.block_until_ready(g_step(params, state, *group_shards(xb, yb)))
    if (i + 1) % 10 == 0:
        for g in (0, 1):
            group_acc[g].append(float(accuracy(replica(params, g))))

models = [replica(params, g) for g in (0, 1)]  # replicas 0 and 1: one of each group
logits = sum(model.apply({"params": m}, x_test) for m in models)
same = all(
    bool(np.all(np.asarray(a)[groups[0]] == np.asarray(a)[groups[0][0]]))
    for a in jax.tree.leaves(params)
)
print("replicas within a group stay identical:", same)
print(
    "group accuracies:",
    [round(c[-1], 3) for c in group_acc.values()],
    "ensemble:",
    round(float((logits.argmax(-1) == y_test).mean()), 3),
)

# %% [markdown]
# ## Replica groups under `jax.shard_map`: the groups as a mesh axis
#
# `shard_map` has no `axis_index_groups`. `cross_shard` still honours a
# `group_assignment` on a 1-D mesh (with collective permutes or a padded
# all-reduce), but when the devices can be laid out by group,
# `optax_accum.replica_group_mesh` makes the groups a mesh axis, and the reduction
# over the other axis is one plain all-reduce per group: the fast path on a pod.
# Each group's model is sharded over the "group" axis. (This needs one device per
# replica, so it is skipped on a single device.)

# %%
if n != R:  # a mesh has one device per replica
    print(f"skipped: the mesh needs {R} devices, this runtime has {n}")
else:
    gmesh = optax_accum.replica_group_mesh(groups)  # axes ("group", "replica")
    rtx = optax_accum.cross_shard_optimizer(optax.sgd(LR), axis_name="replica")
    order = np.ravel(groups)  # position (g, j) of the mesh is replica groups[g][j]

    def mesh_group_step(params, state, xb, yb):
        own = jax.tree.map(lambda a: a[0], params)  # this group's model
        grads = jax.grad(loss_fn)(jax.lax.pcast(own, "replica", to="varying"), xb[0], yb[0])
        updates, state = rtx.update(grads, state, own)  # pmean over "replica" only
        return jax.tree.map(lambda a: a[None], optax.apply_updates(own, updates)), state

    mesh_group_step = jax.jit(
        jax.shard_map(
            mesh_group_step,
            mesh=gmesh,
            in_specs=(P("group"), P(), P(("group", "replica")), P(("group", "replica"))),
            out_specs=(P("group"), P()),
        )
    )
    params = jax.tree.map(lambda a, b: jnp.stack([a, b]), init_params, second)
    state = rtx.init(init_params)
    for xb, yb in tqdm(group_batches, desc="group mesh"):
        xs, ys = group_shards(xb, yb)
        params, state = jax.block_until_ready(mesh_group_step(params, state, xs[order], ys[order]))
    diff = max(largest_difference(replica(params, g), models[g]) for g in (0, 1))
    print(f"two models on a {dict(gmesh.shape)} mesh; differ from pmap's groups by {diff:.1e}")

# %% [markdown]
# ## FSDP: sharded parameters under `jax.jit`
#
# Pods also train with plain `jax.jit` over a device mesh, each parameter split over
# the devices (FSDP) and the batch with them. optax_accum's state is laid out like the
# params: `state_shardings` gives `jax.jit(tx.init)` that layout, so no device ever
# holds the whole state. Here `conditional_accumulator` averages 4 batches an update.

# %%
import functools

from jax.sharding import NamedSharding

fmesh = jax.make_mesh((n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))


def fsdp_spec(a):  # a kernel's rows split over the devices; the rest kept whole
    return P("fsdp") if a.ndim == 2 and a.shape[0] % n == 0 else P()


fparams = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(fmesh, fsdp_spec(a))), init_params)
ftx = optax_accum.conditional_accumulator(optax.adam(1e-2), num_required=4)
fstate = jax.jit(ftx.init, out_shardings=optax_accum.state_shardings(ftx, fparams))(fparams)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def fsdp_step(params, state, xb, yb):
    grads = jax.grad(loss_fn)(params, xb, yb)  # sharded like the params
    return optax_accum.apply_gradients(ftx, grads, state, params)


data = NamedSharding(fmesh, P("fsdp"))
for xb, yb in tqdm(batches[:80], desc="FSDP"):
    fparams, fstate = fsdp_step(fparams, fstate, jax.device_put(xb, data), jax.device_put(yb, data))
kernel = max(jax.tree.leaves(fstate.storage), key=lambda a: a.size)
updates = int(optax_accum.global_step(fstate))
print(f"FSDP accuracy {float(accuracy(fparams)):.3f} after {updates} updates")
print(f"each device holds {kernel.addressable_shards[0].data.shape} of the {kernel.shape} sum")

# %%
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.plot(pmap_loss)
ax1.set_xlabel("step")
ax1.set_ylabel("training loss (mean over devices)")
ax1.set_title(f"cross_shard_optimizer on {n} devices")
for g, curve in group_acc.items():
    ax2.plot(10 * np.arange(1, len(curve) + 1), curve, label=f"group {g}")
ax2.set_xlabel("step")
ax2.set_ylabel("test accuracy")
ax2.set_title("Two replica groups, two models")
ax2.legend()
plt.show()
