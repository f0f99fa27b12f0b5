# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: agn_vs_sync_sgd.ipynb
#     provenance: []
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # AGN (local SGD) against synchronous SGD
#
# On Colab: File > Upload notebook, and give the first cell optax_accum as it says.
# It runs on a TPU runtime (all its cores, or one chip), a GPU runtime (one device)
# or a CPU runtime (simulated devices).
#
# `tf.contrib.opt.AGNOptimizer` (Accumulated Gradient Normalization, Hermans et al.
# 2017) lets every worker take `communication_period` local steps, then averages the
# accumulated gradients into a shared centre model and pulls it back: one all-reduce
# every `communication_period` steps instead of one every step. In optax_accum it is
# `agn(inner, communication_period, axis_name=...)`, with TF's commit of the
# gradients or the paper's commit of the parameter delta (`commit="delta"`).
#
# Workers (one per TPU core or simulated CPU device; 8 under `jax.vmap` on a single
# device) train an MLP on digits. We compare synchronous data-parallel SGD
# (`cross_shard_optimizer`, one all-reduce per step) with AGN, by steps and by
# all-reduces, then DiLoCo with Streaming DiLoCo (one layer at a time, reduced a step
# late, sent in int8), by the bytes each worker sends.

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
STEPS = 240
PER_DEVICE_BATCH = 16
LR = 0.3
PERIODS = (4, 16)

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
from tqdm.auto import tqdm

import optax_accum

# One worker per device; on a single device (a GPU, one TPU chip), 8 workers
# under jax.vmap, which takes the same axis_name as jax.pmap.
W = n if n > 1 else 8
worker_map = (
    jax.pmap if n == W else (lambda f, axis_name=None: jax.jit(jax.vmap(f, axis_name=axis_name)))
)
print(f"{W} workers ({'one per device' if n == W else 'under jax.vmap'})")
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


# %%
runs = {
    "synchronous SGD": train(
        "sync",
        optax_accum.cross_shard_optimizer(optax.sgd(LR), "workers"),
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
        optax.sgd(LR),
        period,
        axis_name="workers",
        commit="delta",
        outer=optax.sgd(float(period)),
    )
for name, agn_tx in agn_runs.items():
    runs[name] = train(
        name,
        agn_tx,
        model_of=lambda params, state: state.centre,
        rounds_of=lambda state, step: int(optax_accum.global_step(state)),
    )
print(f"{'method':26} {'accuracy':>8} {'all-reduces':>11}")
for name, log in runs.items():
    print(f"{name:26} {log[-1, 2]:8.3f} {int(log[-1, 1]):11d}")

# %% [markdown]
# **Streaming DiLoCo.** DiLoCo is the delta commit with an outer Nesterov step,
# `outer=optax.sgd(0.7 * period, momentum=0.9, nesterov=True)`. Streaming DiLoCo
# (arXiv 2501.18512) syncs the model in fragments, here one per layer
# (`fragments=` a function of a param's path), each every `period` steps at its own
# offset; `delay=1` reduces a fragment's pseudo-gradient in the step after its sync step
# (known when that step starts, so the reduction can run beside its forward and
# backward passes), and `communication_dtype=jnp.int8` sends it in int8, with a
# float32 scale per 256 values, summing in float32.

# %%
DILOCO_OUTER = optax.sgd(0.7 * PERIODS[0], momentum=0.9, nesterov=True)


def layer(path):  # the MLP's params: {"Dense_0": {...}, "Dense_1": {...}}
    return int(str(path[0].key).rsplit("_", 1)[-1])


def int8_bytes(leaves):
    # int8 values and a float32 scale per block of 256 values (a leaf's last block
    # padded), the blocks shared evenly between the W workers (padded too)
    blocks = sum(-(-x.size // 256) for x in leaves)
    return -(-blocks // W) * W * (256 + 4)


float32_bytes = sum(x.nbytes for x in jax.tree.leaves(init_params))
flat = jax.tree_util.tree_flatten_with_path(init_params)[0]
fragment_bytes = [int8_bytes([x for p, x in flat if layer(p) == f]) for f in (0, 1)]
streaming_runs = {
    "DiLoCo, float32": (
        optax_accum.agn(
            optax.sgd(LR), PERIODS[0], axis_name="workers", commit="delta", outer=DILOCO_OUTER
        ),
        lambda syncs: syncs * float32_bytes,
    ),
    "Streaming DiLoCo, int8": (
        optax_accum.agn(
            optax.sgd(LR),
            PERIODS[0],
            axis_name="workers",
            commit="delta",
            outer=DILOCO_OUTER,
            fragments=layer,
            delay=1,
            communication_dtype=jnp.int8,
        ),
        # the syncs alternate between the two layers, the first layer first
        lambda syncs: syncs // 2 * sum(fragment_bytes) + syncs % 2 * fragment_bytes[0],
    ),
}
sent_bytes = {"synchronous SGD": runs["synchronous SGD"][:, 1] * float32_bytes}
for name, (tx, bytes_of) in streaming_runs.items():
    runs[name] = train(
        name,
        tx,
        model_of=lambda params, state: state.centre,
        rounds_of=lambda state, step: int(optax_accum.global_step(state)),
    )
    sent_bytes[name] = bytes_of(runs[name][:, 1].astype(int))
print(f"{'method':26} {'accuracy':>8} {'syncs':>6} {'kB sent':>8}")
for name, moved in sent_bytes.items():
    log = runs[name]
    print(f"{name:26} {log[-1, 2]:8.3f} {int(log[-1, 1]):6d} {moved[-1] / 1e3:8.1f}")

# %%
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for name, log in runs.items():
    ax1.plot(log[:, 0], log[:, 2], label=name)
    sent = log[:, 1] > 0
    ax2.plot(log[sent, 1], log[sent, 2], label=name)
bytes_axis = ax1.twinx()  # the bytes each worker sent, dotted, on a second axis
for line in ax1.get_lines():
    if line.get_label() in sent_bytes:
        log = runs[line.get_label()]
        bytes_axis.plot(log[:, 0], sent_bytes[line.get_label()], ":", color=line.get_color())
bytes_axis.set_yscale("log")
bytes_axis.set_ylabel("bytes sent by each worker (dotted)")
ax1.set_xlabel("local steps")
ax1.set_ylabel("test accuracy (centre model)")
ax2.set_xlabel("all-reduces (communication rounds)")
ax2.set_xscale("log")
ax1.legend()
ax1.set_title(f"{W} workers")
ax2.set_title("Accuracy per unit of communication")
plt.show()

# %% [markdown]
# **Reading the result.** Per step, synchronous SGD learns fastest: every step
# uses all workers' gradients. TF's AGN moves the centre by one optimizer step per
# round (the averaged, normalised gradient sum), so per all-reduce it tracks
# synchronous SGD while communicating `communication_period` times less often.
# The delta commit with `outer=optax.sgd(period)` averages the workers' models
# instead, so each round carries all `period` local steps: compare the curves
# per all-reduce on the right. Differences from TF: the centre keeps its own
# optimizer state (TF shared Adam's step counters between local and centre
# updates), and `outer=`/`commit=` are additions (DiLoCo is
# `outer=optax.sgd(0.7 * period, momentum=0.9, nesterov=True)` with the delta
# commit). Streaming DiLoCo reaches DiLoCo's accuracy while each worker sends less than
# half its bytes, and no sync sends more than one layer: the dotted lines on the left
# panel's second axis. On this small MLP the padding of int8's blocks of 256 values
# costs much of the 4x that int8 saves on a large model.
