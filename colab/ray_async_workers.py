# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: ray_async_workers.ipynb
#     provenance: []
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Asynchronous workers on Ray: TF's ConditionalAccumulator across processes
#
# On Colab: File > Upload notebook, and give the first cell optax_accum as it says.
# It runs on a TPU runtime, a GPU runtime or a CPU runtime; the workers run on the
# runtime's CPUs, as Ray processes.
#
# TF1's asynchronous training placed a `tf.ConditionalAccumulator` with a
# `shared_name` on a parameter server: workers on other machines applied gradients
# tagged with the step they read, and a chief took their mean. `optax_accum.ray` does
# that on a Ray cluster: the accumulator lives in a named Ray actor, and every process
# that builds one with the same `shared_name` reaches it.
#
# Four workers, each on its own shard of the digits and at its own speed (the last
# is slow), compute gradients of an MLP with a jitted step from the parameters they
# read; the chief takes the mean of the first three fresh ones, applies Adam and
# publishes new parameters. A gradient computed from parameters the chief has since
# replaced is stale and dropped. The same run on threads, with the in-process
# accumulator, is beside it: the same code, the same accuracy, in one process.

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
STEPS = 150  # chief updates
WORKERS = 4
NUM_REQUIRED = 3
BATCH = 32
DELAYS = (0.0, 0.005, 0.01, 0.05)  # seconds each worker spends per gradient besides computing

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
# Ray: on Colab, install it if missing. A local cluster on this machine's CPUs; on a
# real cluster, `ray.init(address="auto")` joins it instead. Keep a cluster private:
# any process that can join it can reach the accumulator (see the guide).
if "google.colab" in sys.modules and importlib.util.find_spec("ray") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "ray>=2.60"], check=True)

import ray

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

# %%
# What the workers and the chief run, the same on threads and on Ray. The
# accumulator holds one array: train on the flattened parameters.
import threading
import time

import optax
from jax.flatten_util import ravel_pytree

import optax_accum
import optax_accum.ray

flat, unravel = ravel_pytree(init_params)
grad_fn = jax.jit(lambda flat, xb, yb: ravel_pytree(jax.grad(loss_fn)(unravel(flat), xb, yb))[0])


def work(acc, read, i):
    """Worker i: reads (params, step, stop), computes a gradient on its own shard, sends it
    tagged with that step; returns how many it sent."""
    rng, sent = np.random.default_rng(i), 0
    sample_own = notebook.sampler(x_train[i::WORKERS], y_train[i::WORKERS])
    while True:
        params, step, stop = read()
        if stop:
            return sent
        grad = np.asarray(grad_fn(params, *sample_own(rng, BATCH)))
        time.sleep(DELAYS[i])
        acc.apply_grad(grad, local_step=step)
        sent += 1


def chief(acc, publish):
    """Takes the mean of NUM_REQUIRED fresh gradients, applies Adam, publishes; returns
    the final params and the seconds from the first take on (the workers are up)."""
    opt = optax.adam(3e-3)
    params, start = flat, None
    opt_state = opt.init(params)
    for step in range(1, STEPS + 1):
        grad = acc.take_grad(NUM_REQUIRED, timeout=300)
        start = start or time.perf_counter()
        updates, opt_state = opt.update(grad, opt_state, params)
        params = optax.apply_updates(params, updates)
        publish(np.asarray(params), step, step == STEPS)
    return params, time.perf_counter() - start


# %%
# Threads: one process, the in-process accumulator.
acc = optax_accum.ConditionalAccumulator(np.float32, shape=flat.shape)
board = [(np.asarray(flat), 0, False)]  # what workers read: (params, step, stop)


def publish(params, step, stop):
    board[0] = (params, step, stop)


sent = [0] * WORKERS


def thread_worker(i):
    sent[i] = work(acc, lambda: board[0], i)


threads = [threading.Thread(target=thread_worker, args=(i,)) for i in range(WORKERS)]
for t in threads:
    t.start()
params, seconds = chief(acc, publish)
for t in threads:
    t.join()
results = {"threads": (float(accuracy(unravel(params))), seconds, sum(sent), acc.num_dropped)}


# %%
# Ray: four worker processes and the accumulator's actor. The chief publishes the
# params on a small actor that the workers read.
@ray.remote(num_cpus=0)
class Board:
    def __init__(self, params):
        self.value = (params, 0, False)

    def publish(self, params, step, stop):
        self.value = (params, step, stop)

    def read(self):
        return self.value


@ray.remote(num_cpus=0.5)
def ray_worker(i, board):
    acc = optax_accum.ray.ConditionalAccumulator(np.float32, flat.shape, shared_name="grads")
    return work(acc, lambda: ray.get(board.read.remote()), i)


acc = optax_accum.ray.ConditionalAccumulator(np.float32, flat.shape, shared_name="grads")
board = Board.remote(np.asarray(flat))
workers = [ray_worker.remote(i, board) for i in range(WORKERS)]
params, seconds = chief(acc, lambda *value: ray.get(board.publish.remote(*value)))
sent = ray.get(workers)
results["Ray"] = (float(accuracy(unravel(params))), seconds, sum(sent), acc.num_dropped)
acc.kill()
ray.shutdown()

# %%
import matplotlib.pyplot as plt

print(f"{'':8} {'accuracy':>9} {'updates/s':>10} {'gradients/s':>12} {'dropped':>8}")
for name, (acc_, seconds, sent_, dropped) in results.items():
    rates = ((STEPS - 1) / seconds, sent_ / seconds)  # sent_ counts the first take's too
    print(f"{name:8} {acc_:9.3f} {rates[0]:10.1f} {rates[1]:12.1f} {dropped:8d}")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
names = list(results)
ax1.bar(names, [results[n][0] for n in names])
ax1.set_ylabel("test accuracy")
ax1.set_title(f"{STEPS} chief updates, mean of {NUM_REQUIRED} fresh gradients")
width = 0.35
x = np.arange(len(names))
ax2.bar(x - width / 2, [results[n][2] - results[n][3] for n in names], width, label="accepted")
ax2.bar(x + width / 2, [results[n][3] for n in names], width, label="dropped (stale)")
ax2.set_xticks(x, names)
ax2.set_title("Gradients")
ax2.legend()
plt.show()

# %% [markdown]
# **Notes.** Each worker process compiled its own jitted step and sent its
# gradients as host NumPy through Ray's object store; the chief got a `jax.Array`
# back, as from the in-process object. On one machine the threads are faster (no
# processes between them); Ray is what spans machines. A worker killed mid-apply
# loses nothing already accepted, and a chief killed while waiting consumes nothing;
# with `checkpoint_dir=` and `max_restarts=` the accumulator's actor survives its own
# crash. Who can reach a Ray cluster, and how to keep it private: the guide's Ray
# section.
