# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: sparse_embeddings.ipynb
#     provenance: []
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Row-sparse gradients for embeddings
#
# On Colab: File > Upload notebook, and give the first cell optax_accum as it says.
# It runs on a TPU runtime (all its cores, or one chip), a GPU runtime (one device)
# or a CPU runtime (simulated devices).
#
# An embedding table's gradient touches only the rows a batch looked up.
# TensorFlow 1.x's `tf.sparse.SparseConditionalAccumulator` accumulated such
# gradients as `(indices, values, shape)` and averaged each row over the gradients
# that touched it. optax_accum's `sparse_conditional_accumulator` does the same with
# `IndexedSlices` pytrees inside jit, with a fixed row `capacity` so shapes stay
# static, and `optax_accum.apply_updates` scatter-adds the released rows.
#
# Our model reads each digit as a bag of tokens, one per lit pixel
# (`pixel * 16 + intensity`), sums their embeddings, and classifies the sum. We get
# the row-sparse gradient by differentiating with respect to the gathered rows, not
# the table, and compare with dense accumulation of the full table gradient.

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
STEPS = 300
BATCH = 16
NUM_REQUIRED = 2
CAPACITY = 768  # distinct rows held between releases; more is rejected, never cut
DIM = 32
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
    emb = optax_accum.IndexedSlices(ids.reshape(-1), g_rows.reshape(-1, DIM), params["emb"].shape)
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
assert np.allclose(
    g["emb"].to_dense(),
    dense_grads(init_params, jnp.asarray(tokens(x_train[:BATCH])), y_train[:BATCH])["emb"],
    atol=1e-6,
)
print("one batch touches", len(np.unique(tokens(x_train[:BATCH]))), "of", VOCAB, "rows")


# %% [markdown]
# ## Sparse and dense accumulation, side by side
#
# `sparse_sgd` updates only the released rows; the dense run accumulates the full
# table gradient with `conditional_accumulator` and plain SGD. With
# `reduction="sum"` both follow the same arithmetic, so they reach the same
# parameters. (With the default "mean" they differ by design: like TF, the sparse
# accumulator divides each row by the number of gradients that touched it, the
# dense one divides everything by the number of gradients.)


# %%
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
print(
    "updates:",
    int(optax_accum.global_step(state)),
    "| gradients rejected for overflowing the capacity:",
    int(state.num_overflowed),
)
diff = max(
    float(jnp.abs(a - b).max())
    for a, b in zip(jax.tree.leaves(sparse_run[0]), jax.tree.leaves(dense_run[0]), strict=True)
)
print(
    f"accuracy sparse {sparse_run[2][-1]:.3f}, dense {dense_run[2][-1]:.3f}; "
    f"largest parameter difference {diff:.1e}"
)

# %%
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

# %% [markdown]
# **Notes.** Each update of the sparse accumulator touches only the gradient's rows;
# a release sorts at most `capacity` rows. A gradient that would push a table past
# `capacity` distinct rows is rejected whole and counted in `num_overflowed`, so
# pick `capacity` for `num_required` batches of distinct ids. For Adam or any dense
# optimizer, use `optax.chain(optax_accum.densify(), optax.adam(...))` as the inner
# optimizer: it works on the dense table, but only on releasing steps. For Flax
# models with `nn.Embed` layers, `optax_accum.embedding_value_and_grad(loss_fn)`
# does the differentiation with respect to the looked-up rows for you.
