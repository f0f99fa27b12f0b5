"""Writes the notebooks in colab/ from the cells below, without outputs.

    python colab/make_notebooks.py

Edit the cells here, not the .ipynb files, and re-run: the notebooks stay clean
(no outputs, stable cell ids) and share one setup, data and model cell. Every
notebook has a cell tagged "parameters" whose `STEPS` tests/test_notebooks.py
overrides to run it quickly.
"""

from __future__ import annotations

import pathlib
import re
import textwrap
import tomllib

import nbformat
from nbformat import v4

HERE = pathlib.Path(__file__).resolve().parent
PYPROJECT = tomllib.loads((HERE.parent / "pyproject.toml").read_text())
# The project's public address lives in one place: pyproject.toml's [project.urls]
# Repository. Until it is filled in, the notebooks have no Colab badge and install
# optax_accum from a wheel or a clone uploaded to the Colab runtime.
REPOSITORY = PYPROJECT["project"].get("urls", {}).get("Repository")
# The oldest jax optax_accum supports, from its dependencies ("jax>=0.8.0").
MIN_JAX = next(
    re.fullmatch(r"jax>=([\d.]+)", d)[1]
    for d in PYPROJECT["project"]["dependencies"]
    if d.startswith("jax>=")
)


def badge(name: str) -> str:
    """The "Open in Colab" badge, or "" while the repository's address is unknown."""
    if not REPOSITORY:
        return ""
    path = REPOSITORY.removeprefix("https://github.com/").rstrip("/")
    url = f"https://colab.research.google.com/github/{path}/blob/main/colab/{name}.ipynb"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


SETUP = """
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

REPOSITORY = @REPOSITORY@  # where pip gets optax_accum; None: from an upload
MIN_JAX = @MIN_JAX@


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
            f.write(f"{dist}=={importlib.metadata.version(dist)}\\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", keep]
    subprocess.run([*pip, source], check=True)
    # The demo's libraries: Colab has them; install only what is missing.
    wanted = {"flax": "flax", "sklearn": "scikit-learn", "matplotlib": "matplotlib",
              "tqdm": "tqdm"}
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
""".replace("@REPOSITORY@", repr(REPOSITORY)).replace("@MIN_JAX@", repr(MIN_JAX))

DATA = """
# scikit-learn's bundled 8x8 digits (1797 images, no download), scaled to [0, 1].
import numpy as np
from sklearn.datasets import load_digits

x, y = load_digits(return_X_y=True)
x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
cut = int(0.8 * len(x))
x_train, y_train, x_test, y_test = x[:cut], y[:cut], x[cut:], y[cut:]
print("train", x_train.shape, "test", x_test.shape)


def sample(rng, size):
    idx = rng.integers(0, len(x_train), size)
    return x_train[idx], y_train[idx]
"""

MODEL = """
# A small MLP in Flax linen, its loss, and test accuracy.
import flax.linen as nn
import jax.numpy as jnp
import optax


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


model = MLP()
init_params = model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]


def loss_fn(params, xb, yb):
    logits = model.apply({"params": params}, xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()


@jax.jit
def accuracy(params):
    return (model.apply({"params": params}, x_test).argmax(-1) == y_test).mean()
"""


def open_it(name: str) -> str:
    """How to run the notebook: its Colab badge, or how to get it there."""
    where = (
        badge(name)
        or "On Colab: File > Upload notebook, and give the first cell optax_accum as it says."
    )
    return (
        f"{where} It runs on a TPU runtime (all its cores, or one chip), a GPU runtime "
        "(one device) or a CPU runtime (simulated devices)."
    )


def cells_for(name: str, title: str, intro: str, params: str, body: list[str]) -> list:
    cells = [
        v4.new_markdown_cell(f"# {title}\n\n{open_it(name)}\n\n{textwrap.dedent(intro).strip()}"),
        v4.new_code_cell(SETUP.strip()),
        v4.new_code_cell(textwrap.dedent(params).strip(), metadata={"tags": ["parameters"]}),
        v4.new_code_cell(DATA.strip()),
    ]
    for text in body:
        text = textwrap.dedent(text).strip()
        if text.startswith("## ") or text.startswith("**"):
            cells.append(v4.new_markdown_cell(text))
        else:
            cells.append(v4.new_code_cell(text))
    return cells


NOTEBOOKS: dict[str, tuple[str, str, str, list[str]]] = {}

NOTEBOOKS["accumulation_with_staleness"] = (
    "Gradient accumulation with stale workers",
    """
    Asynchronous workers compute gradients on the parameters they last pulled, so a slow
    worker's gradient arrives stale. TensorFlow 1.x handled this with
    `tf.ConditionalAccumulator` (tag each gradient with the global step it was computed
    at, drop the stale ones, release the mean of `num_required` fresh ones) and
    `tf.contrib.opt.DropStaleGradientOptimizer` (apply each gradient unless it is more
    than `staleness` steps old). `optax_accum` has both as Optax transforms:
    `conditional_accumulator` and `drop_stale_gradients`, fed the tag as the extra
    argument `local_step`.

    Here four simulated workers train an MLP on digits; worker 0 is a straggler. We
    compare plain asynchronous Adam and `optax.MultiSteps` (both use every gradient,
    stale or not) with the two optax_accum transforms.
    """,
    """
    STEPS = 300  # gradients delivered to the learner
    WORKERS = 4
    STRAGGLER_SLOWDOWN = 6.0  # worker 0 takes this many times longer per gradient
    BATCH = 32
    EVAL_EVERY = 10
    """,
    [
        MODEL,
        """
        ## Simulated asynchronous workers

        Worker `w` needs an exponentially distributed time per gradient (worker 0 is
        slower). Each gradient is computed on the parameters the worker pulled after its
        previous delivery, and tagged with the global step it saw then.
        """,
        """
        import heapq

        from tqdm.auto import tqdm

        import optax_accum


        def arrival_order(steps, workers, seed=0):
            rng = np.random.default_rng(seed)
            mean = np.ones(workers)
            mean[0] = STRAGGLER_SLOWDOWN
            events = [(rng.exponential(m), w) for w, m in enumerate(mean)]
            heapq.heapify(events)
            order = []
            while len(order) < steps:
                t, w = heapq.heappop(events)
                order.append(w)
                heapq.heappush(events, (t + rng.exponential(mean[w]), w))
            return order


        ORDER = arrival_order(STEPS, WORKERS)
        grad_fn = jax.jit(jax.grad(loss_fn))


        def global_step(state):
            try:
                return int(optax_accum.global_step(state))
            except ValueError:  # plain optax states have no global step
                return 0


        def train(name, tx):
            tx = optax.with_extra_args_support(tx)
            update = jax.jit(lambda g, s, p, tag: tx.update(g, s, p, local_step=tag))
            params = init_params
            state = tx.init(params)
            pulled = [(params, 0)] * WORKERS  # (params, global step) each worker last saw
            rng = np.random.default_rng(1)
            curve = []
            for i, w in enumerate(tqdm(ORDER, desc=name)):
                snapshot, tag = pulled[w]
                grads = grad_fn(snapshot, *sample(rng, BATCH))
                updates, state = update(grads, state, params, tag)
                params = optax.apply_updates(params, updates)
                pulled[w] = (params, global_step(state))
                if (i + 1) % EVAL_EVERY == 0:
                    curve.append(float(accuracy(params)))
            return params, state, curve
        """,
        """
        ## Four learners, the same workers
        """,
        """
        LR = 3e-3
        methods = {
            "async adam": optax.adam(LR),
            "MultiSteps(adam, 3)": optax.MultiSteps(optax.adam(LR), 3).gradient_transformation(),
            "drop_stale_gradients(adam, 2)": optax_accum.drop_stale_gradients(optax.adam(LR), 2),
            "conditional_accumulator(adam, 3)": optax_accum.conditional_accumulator(
                optax.adam(LR), num_required=3
            ),
        }
        results = {name: train(name, tx) for name, tx in methods.items()}
        """,
        """
        print(f"{'method':36} {'accuracy':>8} {'updates':>8} {'dropped':>8}")
        for name, (params, state, curve) in results.items():
            try:
                dropped = int(state.num_dropped)
                updates = int(optax_accum.global_step(state))
            except AttributeError:
                dropped = 0
                updates = STEPS // 3 if name.startswith("MultiSteps") else STEPS
            print(f"{name:36} {curve[-1]:8.3f} {updates:8d} {dropped:8d}")
        """,
        """
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, (_, _, curve) in results.items():
            ax.plot(EVAL_EVERY * np.arange(1, len(curve) + 1), curve, label=name)
        ax.set_xlabel("gradients delivered")
        ax.set_ylabel("test accuracy")
        ax.set_title("Digits with a straggling worker")
        ax.legend()
        plt.show()
        """,
        """
        **Reading the result.** The accumulator applies fewer updates: each one waits
        for three gradients computed at the current global step, and everything the
        straggler (and anyone who pulled before the last release) sends is dropped
        (the `dropped` column). On this small problem stale gradients do little harm,
        so the methods that use every gradient learn faster per gradient delivered;
        the accumulator buys exactness (every update is TF's synchronous mean of
        fresh gradients) with discarded work, like TF's `SyncReplicasOptimizer`.
        `drop_stale_gradients` keeps asynchronous SGD's update rate and only bounds
        the staleness. `optax_accum.global_step`, `num_accumulated` and
        `set_global_step` read and move the counters like TF's accumulator methods.
        """,
    ],
)

NOTEBOOKS["data_parallel_cross_shard"] = (
    "Data-parallel training with cross-shard averaging and replica groups",
    """
    `tf.tpu.CrossShardOptimizer` averaged gradients across TPU cores before applying
    them, optionally within replica subgroups (`group_assignment`). In optax_accum that
    is `cross_shard_optimizer(inner, axis_name, group_assignment=...)` (or the
    chainable `cross_shard`), and it runs under `jax.pmap` and `jax.shard_map` alike.

    We train an MLP on digits with one batch shard per device, check that it matches
    single-device training on the whole batch, and then split the devices into two
    replica groups that train two models at once: an ensemble for the price of one job.
    """,
    """
    STEPS = 200
    PER_DEVICE_BATCH = 16
    LR = 0.5
    """,
    [
        MODEL,
        """
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


        def unreplicate(tree):
            return jax.tree.map(lambda a: a[0], tree)
        """,
        """
        ## `jax.pmap`: every device averages with all the others
        """,
        """
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
        pmap_params = unreplicate(params)
        print("pmap accuracy", float(accuracy(pmap_params)))
        """,
        """
        # The same steps on one device, on the whole global batch.
        sgd = optax.sgd(LR)


        @jax.jit
        def single_step(params, state, xb, yb):
            updates, state = sgd.update(jax.grad(loss_fn)(params, xb, yb), state, params)
            return optax.apply_updates(params, updates), state


        params, state = init_params, sgd.init(init_params)
        for xb, yb in tqdm(batches, desc="one device"):
            params, state = single_step(params, state, xb, yb)
        diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
            jax.tree.leaves(params), jax.tree.leaves(pmap_params)))
        print(f"largest difference from single-device training: {diff:.2e}")
        """,
        """
        ## `jax.shard_map`: the same step over a device mesh

        Under `shard_map` each device's gradient must be its own (varying over the
        axis), so we differentiate with respect to `jax.lax.pcast(params, ...,
        to="varying")`; `cross_shard` then averages it, and the result is replicated.
        """,
        """
        mesh = jax.make_mesh((n,), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))


        def sm_step(params, state, xb, yb):
            local = jax.lax.pcast(params, "devices", to="varying")
            grads = jax.grad(loss_fn)(local, xb[0], yb[0])
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state


        sm_step = jax.jit(jax.shard_map(
            sm_step, mesh=mesh, in_specs=(P(), P(), P("devices"), P("devices")),
            out_specs=(P(), P()),
        ))
        params, state = init_params, tx.init(init_params)
        for xb, yb in tqdm(batches, desc="shard_map"):
            # One step in flight at a time: on a few oversubscribed CPU cores, many
            # queued steps of 8 simulated devices can stall XLA:CPU's collectives.
            params, state = jax.block_until_ready(sm_step(params, state, *shards(xb, yb)))
        diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
            jax.tree.leaves(params), jax.tree.leaves(pmap_params)))
        print(f"shard_map accuracy {float(accuracy(params)):.3f}; differs from pmap by {diff:.2e}")
        """,
        """
        ## Replica groups: two models in one job

        With `group_assignment=[[0, 2, 4, 6], [1, 3, 5, 7]]`, each device averages
        only with its group. Starting the two groups from different initialisations
        trains two independent models; averaging their logits gives a small ensemble.
        Two groups need an even number of replicas: with one device (a GPU, or a single
        TPU chip), 8 replicas run on it under `jax.vmap`, which takes the same
        `axis_name` and groups as `jax.pmap`.
        """,
        """
        R = n if n % 2 == 0 else 8  # replicas: one per device, or 8 on one device
        replica_map = jax.pmap if R == n else (
            lambda f, axis_name=None: jax.jit(jax.vmap(f, axis_name=axis_name)))
        groups = [list(range(0, R, 2)), list(range(1, R, 2))]
        print(f"{R} replicas ({'one per device' if R == n else 'under jax.vmap'}), groups {groups}")
        gtx = optax_accum.cross_shard_optimizer(
            optax.sgd(LR), axis_name="devices", group_assignment=groups
        )
        second = model.init(jax.random.key(1), jnp.zeros((1, 64)))["params"]
        params = jax.tree.map(  # replica r starts from model r % 2
            lambda a, b: jnp.stack([a if r % 2 == 0 else b for r in range(R)]),
            init_params, second,
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
                    group_acc[g].append(float(accuracy(jax.tree.map(lambda a: a[g], params))))

        models = [jax.tree.map(lambda a: a[g], params) for g in (0, 1)]
        logits = sum(model.apply({"params": m}, x_test) for m in models)
        same = all(bool(np.all(np.asarray(a)[groups[0]] == np.asarray(a)[groups[0][0]]))
                   for a in jax.tree.leaves(params))
        print("replicas within a group stay identical:", same)
        print("group accuracies:", [round(c[-1], 3) for c in group_acc.values()],
              "ensemble:", round(float((logits.argmax(-1) == y_test).mean()), 3))
        """,
        """
        ## Replica groups under `jax.shard_map`: the groups as a mesh axis

        `shard_map` has no `axis_index_groups`. `cross_shard` still honours a
        `group_assignment` on a 1-D mesh (with collective permutes or a padded
        all-reduce), but when the devices can be laid out by group,
        `optax_accum.replica_group_mesh` makes the groups a mesh axis, and the reduction
        over the other axis is one plain all-reduce per group: the fast path on a pod.
        Each group's model is sharded over the "group" axis. (This needs one device per
        replica, so it is skipped on a single device.)
        """,
        """
        if R != n:  # a mesh has one device per replica
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


            mesh_group_step = jax.jit(jax.shard_map(
                mesh_group_step, mesh=gmesh,
                in_specs=(P("group"), P(), P(("group", "replica")), P(("group", "replica"))),
                out_specs=(P("group"), P()),
            ))
            params = jax.tree.map(lambda a, b: jnp.stack([a, b]), init_params, second)
            state = rtx.init(init_params)
            for xb, yb in tqdm(group_batches, desc="group mesh"):
                xs, ys = group_shards(xb, yb)
                params, state = jax.block_until_ready(
                    mesh_group_step(params, state, xs[order], ys[order])
                )
            diff = max(
                float(np.abs(np.asarray(a[g]) - np.asarray(b)).max())
                for g in (0, 1)
                for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(models[g]))
            )
            print(f"two models on a {dict(gmesh.shape)} mesh; "
                  f"differ from pmap's groups by {diff:.1e}")
        """,
        """
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
        """,
    ],
)

NOTEBOOKS["sparse_embeddings"] = (
    "Row-sparse gradients for embeddings",
    """
    An embedding table's gradient touches only the rows a batch looked up.
    TensorFlow 1.x's `tf.sparse.SparseConditionalAccumulator` accumulated such
    gradients as `(indices, values, shape)` and averaged each row over the gradients
    that touched it. optax_accum's `sparse_conditional_accumulator` does the same with
    `IndexedSlices` pytrees inside jit, with a fixed row `capacity` so shapes stay
    static, and `optax_accum.apply_updates` scatter-adds the released rows.

    Our model reads each digit as a bag of tokens, one per lit pixel
    (`pixel * 16 + intensity`), sums their embeddings, and classifies the sum. We get
    the row-sparse gradient by differentiating with respect to the gathered rows, not
    the table, and compare with dense accumulation of the full table gradient.
    """,
    """
    STEPS = 300
    BATCH = 16
    NUM_REQUIRED = 2
    CAPACITY = 768  # distinct rows held between releases; more is rejected, never cut
    DIM = 32
    LR = 0.5
    """,
    [
        """
        import jax.numpy as jnp
        import optax
        from tqdm.auto import tqdm

        import optax_accum

        VOCAB = 64 * 16  # (pixel, intensity 1..16) pairs; unlit pixels are padding
        PAD = VOCAB  # an out-of-range id: its rows are ignored


        def tokens(xb):
            level = np.rint(xb * 16).astype(np.int32)
            ids = np.arange(64) * 16 + level - 1
            return np.where(level > 0, ids, PAD).astype(np.int32)


        key_e, key_w = jax.random.split(jax.random.key(0))
        init_params = {
            "emb": 0.1 * jax.random.normal(key_e, (VOCAB, DIM)),
            "w": 0.1 * jax.random.normal(key_w, (DIM, 10)),
            "b": jnp.zeros(10),
        }


        def logits_from_rows(rows, ids, w, b):
            pooled = jnp.where((ids < VOCAB)[..., None], rows, 0.0).sum(1)
            return jax.nn.relu(pooled) @ w + b


        def rows_loss(rows, w, b, ids, yb):
            logits = logits_from_rows(rows, ids, w, b)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()


        def lookup(table, ids):
            return jnp.take(table, ids, axis=0, mode="fill", fill_value=0.0)


        @jax.jit
        def sparse_grads(params, ids, yb):
            # Differentiate with respect to the looked-up rows: d loss / d rows is
            # exactly the table gradient's nonzero rows, as IndexedSlices.
            rows = lookup(params["emb"], ids)
            g_rows, g_w, g_b = jax.grad(rows_loss, argnums=(0, 1, 2))(
                rows, params["w"], params["b"], ids, yb
            )
            emb = optax_accum.IndexedSlices(
                ids.reshape(-1), g_rows.reshape(-1, DIM), params["emb"].shape
            )
            return {"emb": emb, "w": g_w, "b": g_b}


        @jax.jit
        def dense_grads(params, ids, yb):
            def loss(p):
                return rows_loss(lookup(p["emb"], ids), p["w"], p["b"], ids, yb)
            return jax.grad(loss)(params)


        @jax.jit
        def accuracy(params):
            ids = jnp.asarray(tokens(x_test))
            logits = logits_from_rows(lookup(params["emb"], ids), ids, params["w"], params["b"])
            return (logits.argmax(-1) == y_test).mean()


        g = sparse_grads(init_params, jnp.asarray(tokens(x_train[:BATCH])), y_train[:BATCH])
        assert np.allclose(g["emb"].to_dense(), dense_grads(
            init_params, jnp.asarray(tokens(x_train[:BATCH])), y_train[:BATCH])["emb"], atol=1e-6)
        print("one batch touches", len(np.unique(tokens(x_train[:BATCH]))), "of", VOCAB, "rows")
        """,
        """
        ## Sparse and dense accumulation, side by side

        `sparse_sgd` updates only the released rows; the dense run accumulates the full
        table gradient with `conditional_accumulator` and plain SGD. With
        `reduction="sum"` both follow the same arithmetic, so they reach the same
        parameters. (With the default "mean" they differ by design: like TF, the sparse
        accumulator divides each row by the number of gradients that touched it, the
        dense one divides everything by the number of gradients.)
        """,
        """
        def train(name, tx, grad_fn, apply):
            update = jax.jit(tx.update)
            params, state = init_params, tx.init(init_params)
            rng = np.random.default_rng(1)
            curve = []
            for i in tqdm(range(STEPS), desc=name):
                xb, yb = sample(rng, BATCH)
                updates, state = update(grad_fn(params, jnp.asarray(tokens(xb)), yb), state, params)
                params = apply(params, updates)
                if (i + 1) % 10 == 0:
                    curve.append(float(accuracy(params)))
            return params, state, curve


        sparse_tx = optax_accum.sparse_conditional_accumulator(
            optax_accum.sparse_sgd(LR),
            num_required=NUM_REQUIRED,
            capacity=CAPACITY,
            reduction="sum",
            sparse={"emb": True, "w": False, "b": False},
        )
        dense_tx = optax_accum.conditional_accumulator(
            optax.sgd(LR), num_required=NUM_REQUIRED, reduction="sum"
        )
        sparse_run = train("sparse", sparse_tx, sparse_grads, optax_accum.apply_updates)
        dense_run = train("dense", dense_tx, dense_grads, optax.apply_updates)

        state = sparse_run[1]
        print("updates:", int(optax_accum.global_step(state)),
              "| gradients rejected for overflowing the capacity:", int(state.num_overflowed))
        diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
            jax.tree.leaves(sparse_run[0]), jax.tree.leaves(dense_run[0])))
        print(f"accuracy sparse {sparse_run[2][-1]:.3f}, dense {dense_run[2][-1]:.3f}; "
              f"largest parameter difference {diff:.1e}")
        """,
        """
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        steps = 10 * np.arange(1, len(sparse_run[2]) + 1)
        ax.plot(steps, sparse_run[2], label="sparse_conditional_accumulator + sparse_sgd")
        ax.plot(steps, dense_run[2], "--", label="conditional_accumulator + sgd (dense)")
        ax.set_xlabel("gradients")
        ax.set_ylabel("test accuracy")
        ax.set_title("Bag-of-pixels embedding model on digits")
        ax.legend()
        plt.show()
        """,
        """
        **Notes.** Each update of the sparse accumulator touches only the gradient's rows;
        a release sorts at most `capacity` rows. A gradient that would push a table past
        `capacity` distinct rows is rejected whole and counted in `num_overflowed`, so
        pick `capacity` for `num_required` batches of distinct ids. For Adam or any dense
        optimizer, use `optax.chain(optax_accum.densify(), optax.adam(...))` as the inner
        optimizer: it works on the dense table, but only on releasing steps. For Flax
        models with `nn.Embed` layers, `optax_accum.embedding_value_and_grad(loss_fn)`
        does the differentiation with respect to the looked-up rows for you.
        """,
    ],
)

NOTEBOOKS["agn_vs_sync_sgd"] = (
    "AGN (local SGD) against synchronous SGD",
    """
    `tf.contrib.opt.AGNOptimizer` (Accumulated Gradient Normalization, Hermans et al.
    2017) lets every worker take `communication_period` local steps, then averages the
    accumulated gradients into a shared centre model and pulls it back: one all-reduce
    every `communication_period` steps instead of one every step. In optax_accum it is
    `agn(inner, communication_period, axis_name=...)`, with TF's commit of the
    gradients or the paper's commit of the parameter delta (`commit="delta"`).

    Workers (one per TPU core or simulated CPU device; 8 under `jax.vmap` on a single
    device) train an MLP on digits. We compare synchronous data-parallel SGD
    (`cross_shard_optimizer`, one all-reduce per step) with AGN, by steps and by
    all-reduces.
    """,
    """
    STEPS = 240
    PER_DEVICE_BATCH = 16
    LR = 0.3
    PERIODS = (4, 16)
    """,
    [
        MODEL,
        """
        from tqdm.auto import tqdm

        import optax_accum

        # One worker per device; on a single device (a GPU, one TPU chip), 8 workers
        # under jax.vmap, which takes the same axis_name as jax.pmap.
        W = n if n > 1 else 8
        worker_map = jax.pmap if W == n else (
            lambda f, axis_name=None: jax.jit(jax.vmap(f, axis_name=axis_name)))
        print(f"{W} workers ({'one per device' if W == n else 'under jax.vmap'})")
        rng = np.random.default_rng(0)
        batches = [sample(rng, W * PER_DEVICE_BATCH) for _ in range(STEPS)]


        def shards(xb, yb):
            return xb.reshape(W, PER_DEVICE_BATCH, -1), yb.reshape(W, PER_DEVICE_BATCH)


        def replicate(tree):
            return jax.tree.map(lambda a: jnp.stack([a] * W), tree)


        def train(name, tx, model_of, rounds_of):
            # model_of(params, state): the model to evaluate (AGN: the centre);
            # rounds_of(state, step): all-reduces issued so far.
            def step(params, state, xb, yb):
                grads = jax.grad(loss_fn)(params, xb, yb)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            p_step = worker_map(step, axis_name="workers")
            params = replicate(init_params)
            state = worker_map(tx.init)(params)
            log = []
            for i, (xb, yb) in enumerate(tqdm(batches, desc=name)):
                # One step in flight at a time (simulated CPU devices stall otherwise).
                params, state = jax.block_until_ready(p_step(params, state, *shards(xb, yb)))
                if (i + 1) % 8 == 0:
                    p0, s0 = jax.tree.map(lambda a: a[0], (params, state))
                    log.append((i + 1, rounds_of(s0, i + 1), float(accuracy(model_of(p0, s0)))))
            return np.array(log)
        """,
        """
        runs = {
            "synchronous SGD": train(
                "sync", optax_accum.cross_shard_optimizer(optax.sgd(LR), "workers"),
                model_of=lambda params, state: params,
                rounds_of=lambda state, step: step,
            )
        }
        agn_runs = {  # TF's gradient commit, and the paper's delta commit
            f"AGN (TF), period {PERIODS[0]}": optax_accum.agn(
                optax.sgd(LR), PERIODS[0], axis_name="workers"
            )
        }
        for period in PERIODS:  # outer=sgd(period) on the delta: plain model averaging
            agn_runs[f"AGN delta, period {period}"] = optax_accum.agn(
                optax.sgd(LR), period, axis_name="workers",
                commit="delta", outer=optax.sgd(float(period)),
            )
        for name, agn_tx in agn_runs.items():
            runs[name] = train(
                name, agn_tx,
                model_of=lambda params, state: state.centre,
                rounds_of=lambda state, step: int(optax_accum.global_step(state)),
            )
        print(f"{'method':26} {'accuracy':>8} {'all-reduces':>11}")
        for name, log in runs.items():
            print(f"{name:26} {log[-1, 2]:8.3f} {int(log[-1, 1]):11d}")
        """,
        """
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for name, log in runs.items():
            ax1.plot(log[:, 0], log[:, 2], label=name)
            sent = log[:, 1] > 0
            ax2.plot(log[sent, 1], log[sent, 2], label=name)
        ax1.set_xlabel("local steps")
        ax1.set_ylabel("test accuracy (centre model)")
        ax2.set_xlabel("all-reduces (communication rounds)")
        ax2.set_xscale("log")
        ax1.legend()
        ax1.set_title(f"{W} workers")
        ax2.set_title("Accuracy per unit of communication")
        plt.show()
        """,
        """
        **Reading the result.** Per step, synchronous SGD learns fastest: every step
        uses all workers' gradients. TF's AGN moves the centre by one optimizer step per
        round (the averaged, normalised gradient sum), so per all-reduce it tracks
        synchronous SGD while communicating `communication_period` times less often.
        The delta commit with `outer=optax.sgd(period)` averages the workers' models
        instead, so each round carries all `period` local steps: compare the curves
        per all-reduce on the right. Differences from TF: the centre keeps its own
        optimizer state (TF shared Adam's step counters between local and centre
        updates), and `outer=`/`commit=` are additions (DiLoCo is
        `outer=optax.sgd(0.7 * period, momentum=0.9, nesterov=True)` with the delta
        commit).
        """,
    ],
)


NOTEBOOKS["host_accumulator_threads"] = (
    "Threads feeding one learner: TF's ConditionalAccumulator object",
    """
    Actor-learner code ported from TF1 often keeps `tf.ConditionalAccumulator` as an
    object: actor threads call `apply_grad(grad, local_step)`, and the learner blocks in
    `take_grad(num_required)` until enough fresh gradients are in. optax_accum's
    `ConditionalAccumulator` is that object, thread-safe, with the aggregate kept on the
    JAX device. (For jit-able training steps, use the `conditional_accumulator`
    transform instead.)

    Four actor threads compute gradients of an MLP on digits from the parameters they
    read, one per published version; the learner takes the mean of the first three
    fresh ones, applies Adam, and publishes new parameters. A gradient that arrives
    after the learner has moved on is stale and dropped, as in TF.
    """,
    """
    STEPS = 150  # learner updates
    ACTORS = 4
    NUM_REQUIRED = 3
    BATCH = 32
    """,
    [
        MODEL,
        """
        import threading

        from jax.flatten_util import ravel_pytree
        from tqdm.auto import tqdm

        import optax_accum

        # The host accumulator holds one array: train on the flattened parameters.
        flat, unravel = ravel_pytree(init_params)
        grad_fn = jax.jit(
            lambda flat, xb, yb: ravel_pytree(jax.grad(loss_fn)(unravel(flat), xb, yb))[0]
        )
        acc = optax_accum.ConditionalAccumulator(np.float32, shape=flat.shape)
        opt = optax.adam(3e-3)
        opt_state = opt.init(flat)
        latest = (flat, 0)  # what actors read: (params, the global step they belong to)
        published = threading.Condition()  # notified when `latest` changes
        done = False
        sent = [0] * ACTORS


        def actor(i):  # one gradient per published version of the params
            rng = np.random.default_rng(i)
            seen = -1
            while True:
                with published:
                    published.wait_for(lambda: done or latest[1] != seen)
                    if done:
                        return
                    params, seen = latest
                acc.apply_grad(grad_fn(params, *sample(rng, BATCH)), local_step=seen)
                sent[i] += 1


        def publish(params, step, stop=False):
            global latest, done
            with published:
                latest, done = (params, step), stop
                published.notify_all()


        threads = [threading.Thread(target=actor, args=(i,)) for i in range(ACTORS)]
        for t in threads:
            t.start()
        curve = []
        try:
            for step in tqdm(range(1, STEPS + 1), desc="learner"):
                mean_grad = acc.take_grad(NUM_REQUIRED, timeout=120)  # blocks
                updates, opt_state = opt.update(mean_grad, opt_state, flat)
                flat = optax.apply_updates(flat, updates)
                publish(flat, step)
                if step % 10 == 0:
                    curve.append(float(accuracy(unravel(flat))))
        finally:
            publish(flat, STEPS, stop=True)
            for t in threads:
                t.join()
        print(f"learner updates {acc.global_step}, gradients sent {sum(sent)}, "
              f"dropped as stale {acc.num_dropped}, test accuracy {curve[-1]:.3f}")
        """,
        """
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.plot(10 * np.arange(1, len(curve) + 1), curve)
        ax1.set_xlabel("learner updates")
        ax1.set_ylabel("test accuracy")
        ax1.set_title(f"{ACTORS} actor threads, mean of {NUM_REQUIRED} fresh gradients")
        dropped = acc.num_dropped
        ax2.bar(["sent", "accepted", "dropped (stale)"],
                [sum(sent), sum(sent) - dropped, dropped])
        ax2.set_title("Gradients")
        plt.show()
        """,
        """
        **Notes.** Takes are served first come, first served; a take that times out
        consumes nothing; `cancel_waiting_takes()` releases blocked learners, like
        closing TF's session. `SparseConditionalAccumulator` is the same for
        `(indices, values, shape)` gradients. Differences from TF: malformed gradients
        raise even when stale, and bfloat16 is accepted.
        """,
    ],
)


def build(name: str) -> nbformat.NotebookNode:
    title, intro, params, body = NOTEBOOKS[name]
    nb = v4.new_notebook()
    nb.cells = cells_for(name, title, intro, params, body)
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:24]}-{i:02d}"
    nb.metadata = {
        "accelerator": "TPU",
        "colab": {"name": f"{name}.ipynb", "provenance": []},
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name in NOTEBOOKS:
        nbformat.write(build(name), HERE / f"{name}.ipynb")
        print(f"wrote colab/{name}.ipynb")


if __name__ == "__main__":
    main()
