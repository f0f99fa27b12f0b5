# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: host_accumulator_threads.ipynb
#     provenance: []
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Threads feeding one learner: TF's ConditionalAccumulator object
#
# On Colab: File > Upload notebook, and give the first cell optax_accum as it says.
# It runs on a TPU runtime (all its cores, or one chip), a GPU runtime (one device)
# or a CPU runtime (simulated devices).
#
# Actor-learner code ported from TF1 often keeps `tf.ConditionalAccumulator` as an
# object: actor threads call `apply_grad(grad, local_step)`, and the learner blocks in
# `take_grad(num_required)` until enough fresh gradients are in. optax_accum's
# `ConditionalAccumulator` is that object, thread-safe, with the aggregate kept on the
# JAX device. (For jit-able training steps, use the `conditional_accumulator`
# transform instead.)
#
# Four actor threads compute gradients of an MLP on digits from the parameters they
# read, one per published version; the learner takes the mean of the first three
# fresh ones, applies Adam, and publishes new parameters. A gradient that arrives
# after the learner has moved on is stale and dropped, as in TF.

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
STEPS = 150  # learner updates
ACTORS = 4
NUM_REQUIRED = 3
BATCH = 32

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
import threading

import optax
from jax.flatten_util import ravel_pytree
from tqdm.auto import tqdm

import optax_accum

# The host accumulator holds one array: train on the flattened parameters.
flat, unravel = ravel_pytree(init_params)
grad_fn = jax.jit(lambda flat, xb, yb: ravel_pytree(jax.grad(loss_fn)(unravel(flat), xb, yb))[0])
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
            while not done and latest[1] == seen:  # wait for a new version
                published.wait()
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
print(
    f"learner updates {acc.global_step}, gradients sent {sum(sent)}, "
    f"dropped as stale {acc.num_dropped}, test accuracy {curve[-1]:.3f}"
)

# %%
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.plot(10 * np.arange(1, len(curve) + 1), curve)
ax1.set_xlabel("learner updates")
ax1.set_ylabel("test accuracy")
ax1.set_title(f"{ACTORS} actor threads, mean of {NUM_REQUIRED} fresh gradients")
dropped = acc.num_dropped
ax2.bar(["sent", "accepted", "dropped (stale)"], [sum(sent), sum(sent) - dropped, dropped])
ax2.set_title("Gradients")
plt.show()

# %% [markdown]
# **Notes.** Takes are served first come, first served; a take that times out
# consumes nothing; `cancel_waiting_takes()` releases blocked learners, like
# closing TF's session. `SparseConditionalAccumulator` is the same for
# `(indices, values, shape)` gradients. Differences from TF: malformed gradients
# raise even when stale, and bfloat16 is accepted.
