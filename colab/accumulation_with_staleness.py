# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: accumulation_with_staleness.ipynb
#     provenance: []
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Gradient accumulation with stale workers
#
# On Colab: File > Upload notebook, and give the first cell optax_accum as it says.
# It runs on a TPU runtime (all its cores, or one chip), a GPU runtime (one device)
# or a CPU runtime (simulated devices).
#
# Asynchronous workers compute gradients on the parameters they last pulled, so a slow
# worker's gradient arrives stale. TensorFlow 1.x handled this with
# `tf.ConditionalAccumulator` (tag each gradient with the global step it was computed
# at, drop the stale ones, release the mean of `num_required` fresh ones) and
# `tf.contrib.opt.DropStaleGradientOptimizer` (apply each gradient unless it is more
# than `staleness` steps old). `optax_accum` has both as Optax transforms:
# `conditional_accumulator` and `drop_stale_gradients`, fed the tag as the extra
# argument `local_step`.
#
# Here simulated workers train an MLP on digits; worker 0 is a straggler. We compare
# plain asynchronous Adam and `optax.MultiSteps` (both use every gradient, stale or not)
# with the two optax_accum transforms, in two regimes taken from
# `python -m optax_accum.demo`: mild staleness (4 workers, Adam at 3e-3), where using
# every gradient is the better deal, and heavy staleness (16 workers, Adam at 3e-2),
# where stale gradients derail training.

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
STEPS = 300  # gradients delivered to each learner
BATCH = 32
EVAL_EVERY = 10

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

# %% [markdown]
# ## Simulated asynchronous workers
#
# Worker `w` needs an exponentially distributed time per gradient (worker 0 is
# slower). Each gradient is computed on the parameters the worker pulled after its
# previous delivery, and tagged with the global step it saw then. With `W` workers,
# about `W - 1` other gradients arrive between a worker's pull and its delivery: that
# many updates late for async Adam, a third as many for `MultiSteps(adam, 3)`.
#
# The two regimes are the demo's: how many workers, how much slower the straggler, and
# Adam's learning rate.

# %%
import optax
from tqdm.auto import tqdm

import optax_accum
from optax_accum.demo.accumulate import HEAVY, MILD, arrival_order

print(MILD)
print(HEAVY)

# Each learner as a function of the learning rate. The jitted update takes the rate as
# an argument, so that the second regime reuses the first one's compilation.
METHODS = {
    "async adam": optax.adam,
    "MultiSteps(adam, 3)": lambda lr: optax.MultiSteps(optax.adam(lr), 3).gradient_transformation(),
    "drop_stale_gradients(adam, 2)": lambda lr: optax_accum.drop_stale_gradients(optax.adam(lr), 2),
    "conditional_accumulator(adam, 3)": lambda lr: optax_accum.conditional_accumulator(
        optax.adam(lr), num_required=3
    ),
}


def jitted_update(make):
    def update(grads, state, params, tag, lr):
        tx = optax.with_extra_args_support(make(lr))
        return tx.update(grads, state, params, local_step=tag)

    return jax.jit(update)


UPDATES = {name: jitted_update(make) for name, make in METHODS.items()}
grad_fn = jax.jit(jax.grad(loss_fn))


def global_step(state):
    try:
        return int(optax_accum.global_step(state))
    except ValueError:  # plain optax states have no global step
        return 0


def train(name, regime):
    # Which worker delivers each gradient: exponential compute times, worker 0 the slowest.
    order = arrival_order(STEPS, seed=0, workers=regime.workers, slowdown=regime.slowdown)
    lr = regime.learning_rate
    params = init_params
    state = METHODS[name](lr).init(params)
    pulled = [(params, 0)] * regime.workers  # (params, global step) each worker last saw
    rng = np.random.default_rng(1)
    curve = []
    for i, w in enumerate(tqdm(order, desc=f"{regime.name}: {name}")):
        snapshot, tag = pulled[w]
        grads = grad_fn(snapshot, *sample(rng, BATCH))
        updates, state = UPDATES[name](grads, state, params, tag, lr)
        params = optax.apply_updates(params, updates)
        pulled[w] = (params, global_step(state))
        if (i + 1) % EVAL_EVERY == 0:
            curve.append(float(accuracy(params)))
    return params, state, curve


# %% [markdown]
# ## Four learners, the same workers, two regimes

# %%
results = {regime.name: {name: train(name, regime) for name in METHODS} for regime in (MILD, HEAVY)}

# %%
for regime in (MILD, HEAVY):
    print(f"\n{regime.label}")
    print(f"{'method':36} {'accuracy':>8} {'updates':>8} {'dropped':>8}")
    for name, (_, state, curve) in results[regime.name].items():
        try:
            dropped = int(state.num_dropped)
            updates = int(optax_accum.global_step(state))
        except AttributeError:
            dropped = 0
            updates = STEPS // 3 if name.startswith("MultiSteps") else STEPS
        print(f"{name:36} {curve[-1]:8.3f} {updates:8d} {dropped:8d}")

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, regime in zip(axes, (MILD, HEAVY), strict=True):
    for name, (_, _, curve) in results[regime.name].items():
        ax.plot(EVAL_EVERY * np.arange(1, len(curve) + 1), curve, label=name)
    ax.set_xlabel("gradients delivered (the same stream for every learner)")
    ax.set_title(regime.label, fontsize=9)
axes[0].set_ylabel("test accuracy")
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# **Reading the result.** Both panels have the same x axis: gradients delivered, the
# same stream for every learner of a regime.
#
# *Mild staleness* (4 workers, Adam at 3e-3): a gradient is about 3 small updates old
# when async Adam applies it, so it still points downhill, and the methods that use
# every gradient learn faster per gradient delivered. The accumulator applies fewer
# updates: each one waits for three gradients computed at the current global step, and
# everything the straggler (and anyone who pulled before the last release) sends is
# dropped (the `dropped` column). Here `optax.MultiSteps` is enough; the accumulator
# buys exactness (every update is TF's synchronous mean of fresh gradients) with
# discarded work, like TF's `SyncReplicasOptimizer`.
#
# *Heavy staleness* (16 workers, Adam at 3e-2): a gradient is about 14 updates old for
# async Adam and 5 for MultiSteps, each update 10 times larger, so it was computed at
# parameters far from the ones it is applied to, and applying it undoes progress: their
# accuracy stalls and swings. The accumulator drops most gradients and still learns,
# since every update it applies is computed at the current parameters.
# `drop_stale_gradients` keeps asynchronous SGD's update rate and only bounds the
# staleness, which is enough here too. Either change alone (more workers, or the larger
# learning rate) costs much less on this problem; a smaller learning rate is the other
# way out.
#
# `optax_accum.global_step`, `num_accumulated` and `set_global_step` read and move the
# counters like TF's accumulator methods.
