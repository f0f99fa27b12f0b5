"""`optax_accum.ray.ParameterBoard`: the chief publishes each global step's parameters,
workers wait for a step newer than the one they computed at (TF's sync token) and read
them. With a `ConditionalAccumulator`, it is what `tf.train.SyncReplicasOptimizer`
built from a token queue and the parameter server's variables.

The board is a small Ray actor (asyncio: any number of workers can wait) that keeps
the latest `(params, step)` as host NumPy, and imports no JAX. Named, it is detached
and owned by no process, as the accumulators are.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from typing import Any

import ray

from optax_accum.ray._handle import AccumulatorUnavailableError
from optax_accum.ray._spec import NAMESPACE


class _Board:
    """The actor: the latest published value and step, and a condition to wait on."""

    def __init__(self) -> None:
        self._value: Any = None
        self._step: int | None = None
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made in the actor's event loop
            self._changed = asyncio.Condition()
        return self._changed

    async def publish(self, value: Any, step: int) -> BaseException | None:
        if self._step is not None and step <= self._step:
            return ValueError(
                f"step must grow from one publish to the next: {step} after {self._step}"
            )
        async with self._condition():
            self._value, self._step = value, step
            self._condition().notify_all()
        return None

    async def wait(self, after: int | None, timeout: float | None) -> tuple:
        """(value, step) once a step above `after` (None: any) is published; (None,
        None) if `timeout` seconds pass first."""

        def ready() -> bool:
            return self._step is not None and (after is None or self._step > after)

        try:
            async with self._condition():
                await asyncio.wait_for(self._condition().wait_for(ready), timeout)
        except TimeoutError:
            return None, None
        return self._value, self._step


@functools.cache
def _board_class() -> Any:
    return ray.remote(_Board)


def _host(params: Any) -> Any:
    """`params` as host NumPy (a tree of `jax.Array`s is fetched once)."""
    jax = sys.modules.get("jax")
    return params if jax is None else jax.device_get(params)


class ParameterBoard:
    """Where a chief publishes the parameters of each global step for its workers.

    TF's `SyncReplicasOptimizer` kept the variables on a parameter server and gave each
    worker a token per global step: a worker that had sent its gradient blocked on the
    token queue until the chief had applied the step's aggregate. Here the chief
    publishes the new parameters with the accumulator's new `global_step` (`publish`),
    and a worker waits for a step newer than the one its gradient was computed at
    (`wait`), which returns those parameters: one gradient per worker per step, as with TF's tokens,
    and a worker that is late skips to the latest step.

    Every process that builds a board with the same `shared_name` (in the same
    namespace) reaches the same one; it lives until `kill()`. The parameters travel as
    host NumPy (a tree of them).

    Args:
      shared_name: the board's name; None: a new, unnamed board, owned by this
        process (pass the object to Ray tasks and actors).
      namespace: the Ray namespace of the name (None: "optax_accum").

    Example:
      >>> import numpy as np, ray, optax_accum.ray
      >>> _ = ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
      >>> board = optax_accum.ray.ParameterBoard()
      >>> @ray.remote
      ... def worker(board):  # another process: waits for the chief's next step
      ...     params, step = board.wait(after_step=0, timeout=60)
      ...     return params["w"].tolist(), step
      >>> board.publish({"w": np.zeros(2)}, step=0)
      >>> waiting = worker.remote(board)
      >>> board.publish({"w": np.ones(2)}, step=1)
      >>> ray.get(waiting)
      ([1.0, 1.0], 1)
      >>> board.kill()
    """

    def __init__(self, shared_name: str | None = None, *, namespace: str | None = None) -> None:
        for arg, value in (("shared_name", shared_name), ("namespace", namespace)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{arg} must be None or a str, got {value!r}")
        options: dict[str, Any] = {"num_cpus": 0}
        if shared_name:
            options.update(
                name=shared_name,
                namespace=namespace or NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
            )
        self._actor = _board_class().options(**options).remote()

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as error:
            raise AccumulatorUnavailableError(f"the parameter board died: {error}") from error

    def publish(self, params: Any, step: int) -> None:
        """Publishes `params` (a tree of arrays) as those of global step `step`, waking
        the workers that wait for a newer step than theirs.

        Raises:
          TypeError: if `step` is not an int.
          ValueError: if `step` is not above the last published one.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        error = self._get(self._actor.publish.remote(_host(params), step))
        if error is not None:
            raise error

    def read(self, timeout: float | None = None) -> tuple[Any, int]:
        """The latest `(params, step)`, once something is published.

        Raises:
          TimeoutError: if nothing is published within `timeout` seconds.
        """
        return self.wait(None, timeout)

    def wait(self, after_step: int | None, timeout: float | None = None) -> tuple[Any, int]:
        """Blocks until a step above `after_step` is published; returns the latest
        `(params, step)` (TF's sync token: the step's parameters).

        Args:
          after_step: the step this worker's last gradient was computed at (None:
            any step).
          timeout: seconds to wait at most; None waits forever.

        Raises:
          TimeoutError: if no such step is published within `timeout` seconds.
        """
        start = time.monotonic()
        value, step = self._get(self._actor.wait.remote(after_step, timeout))
        if step is None:
            waited = time.monotonic() - start
            raise TimeoutError(
                f"no step after {after_step} was published in {waited:.1f} s (timeout={timeout})"
            )
        return value, step

    def kill(self) -> None:
        """Ends the board, for every process sharing it."""
        ray.kill(self._actor, no_restart=True)
