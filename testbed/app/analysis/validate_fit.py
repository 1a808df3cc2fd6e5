"""Fitting config keys to real runs by least squares, in as few replays as the fit allows (`validate.fit`).

Why: a residual is one replay of one run (seconds to a minute of simulation), so a fit's cost is the
number of replays it asks for, and a leave-one-model-out validation makes one fit per model besides the
fit on all. Two things keep that number down without changing what is fitted:

- `Replays` runs each (run, values) once per command. A run's residuals depend only on the values it
  is replayed with, never on which other runs share the fit, so the fits of a leave-one-model-out
  validation share every replay they have in common: all of them start from the config's values and
  take the same finite-difference steps there, so the Jacobian at the start is simulated once for all
  of them, and the fitted values' replays are reused when the runs are scored. A key the run's replay
  cannot read (`inert_keys`) is replayed at the config's value, so its finite difference there is free.
- `fit` linearises once: a finite-difference Jacobian at the start (one replay of every run per key),
  then each step costs one replay of every run and updates the Jacobian from what the step showed
  (Broyden's rank-one update), a fresh finite-difference Jacobian being taken only when a step fails to
  lower the squared error and an iteration is left to use it. `validate.fit_method=newton` takes a fresh
  Jacobian at every step instead (Gauss-Newton, what the fit did before: one replay of every run per key
  and step more).

Every step is bounded (each key >= 0) and only a step that lowers the squared relative error is taken,
so the result is the best point the fit replayed.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from omegaconf import DictConfig, OmegaConf

from testbed.app.analysis.real_runs import RealRun
from testbed.app.analysis.validate_replay import FIT_METRICS, RunReplay, inert_keys, scored, simulate_run

log = logging.getLogger("testbed.app.analysis.validate_fit")
FIT_METHODS = ("broyden", "newton")


def _values_key(values: dict[str, float] | None) -> tuple:
    return tuple(sorted((k, float(v)) for k, v in (values or {}).items()))


class ReplaysStopped(Exception):
    """`stop()` turned true (a signal, app/entry/stop.py): the replays asked for, those done (None: not done)."""

    def __init__(self, done: list[RunReplay | None]):
        super().__init__(f"stopped with {sum(r is not None for r in done)} of {len(done)} replays done")
        self.done = done


class Replays:
    """The replays of one command, each (run, values) simulated once (`validate.jobs` processes, one
    pool kept for the whole command so that its workers' caches stay warm).

    Asked replays wait in one queue and start costliest first whenever a worker is free, whoever asked
    for them: `run_fits` asks for each fit's next replays as soon as that fit has its last ones, so no
    worker idles at a round's end while another fit has work (the fits used to advance in lockstep, each
    round waiting for its slowest replay). What a replay gives never depends on when or where it ran.

    `stop()` turning true ends the wait with ReplaysStopped: the pool's replays are not awaited
    (`close` kills its workers), a replay in this process ends at its next step."""

    def __init__(self, cfg: DictConfig, stop: Callable[[], bool] | None = None):
        self.cfg = cfg
        self.stop = stop or (lambda: False)
        self.jobs = cfg.validate.jobs or os.cpu_count() or 1
        self._done: dict[tuple, RunReplay] = {}
        self._queued: dict[tuple, tuple[RealRun, dict | None]] = {}  # asked, not started (in asking order)
        self._running: dict = {}  # future -> key
        self._pool: ProcessPoolExecutor | None = None
        self.simulated = 0  # replays run (the rest were found done)
        self.cpu_s = 0.0  # the CPU seconds they took, in whichever process ran them
        self.asked = 0

    def want(self, asks: list[tuple[RealRun, dict[str, float] | None]]) -> list[tuple]:
        """Queue the replays of `asks` not done or under way; their keys, in order (`ready`, `take`)."""
        asks = [(run, self._read(run, values)) for run, values in asks]
        keys = [(str(run.path), _values_key(values)) for run, values in asks]
        self.asked += len(asks)
        for key, ask in zip(keys, asks):
            if key not in self._done and key not in self._queued and key not in self._running.values():
                self._queued[key] = ask
        return keys

    def _read(self, run: RealRun, values: dict[str, float] | None) -> dict[str, float] | None:
        """`values` as the run's replay reads them: a key it cannot read (`inert_keys`) at the config's value,
        so that the replays differing only there are one."""
        inert = inert_keys(self.cfg, run).intersection(values or ())
        if not inert:
            return values
        return {k: float(OmegaConf.select(self.cfg, k)) if k in inert else v for k, v in values.items()}

    def ready(self, keys: list[tuple]) -> bool:
        return all(k in self._done for k in keys)

    def take(self, keys: list[tuple]) -> list[RunReplay]:
        return [self._done[k] for k in keys]

    def get(self, asks: list[tuple[RealRun, dict[str, float] | None]]) -> list[RunReplay]:
        """Each (run, values)'s replay, in order, waiting for those not yet done."""
        keys = self.want(asks)
        try:
            while not self.ready(keys):
                self.advance()
        except ReplaysStopped:
            raise ReplaysStopped([self._done.get(k) for k in keys]) from None
        return self.take(keys)

    def advance(self) -> None:
        """Wait until one more replay is done (in this process: run the costliest queued one)."""
        if not self._queued and not self._running:
            raise RuntimeError("Replays.advance: nothing asked is left to run")
        if self.jobs <= 1:
            key = self._next()
            run, values = self._queued.pop(key)
            t = time.process_time()
            done = None if self.stop() else self._simulate(run, values)
            if done is None:
                raise ReplaysStopped([])
            self._finish(key, done, time.process_time() - t)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.jobs, initializer=_pool_worker, initargs=(os.getpid(),))
        while self._queued and len(self._running) < self.jobs:  # only `jobs` at once: the queue keeps its order
            key = self._next()
            run, values = self._queued.pop(key)
            self._running[self._pool.submit(_timed_replay, self.cfg, run, values)] = key
        finished: set = set()
        while not finished:  # (the timeout: a signal's flag is looked at between results)
            if self.stop():
                raise ReplaysStopped([])
            finished = wait(list(self._running), timeout=0.2, return_when=FIRST_COMPLETED).done
        for f in finished:
            self._finish(self._running.pop(f), *f.result())

    def _next(self) -> tuple:
        """The costliest queued replay (the first asked among equals): long runs start early, so that
        no worker is left with one at the end."""
        return max(self._queued, key=lambda k: _cost(self._queued[k][0]))

    def _simulate(self, run: RealRun, values: dict[str, float] | None) -> RunReplay | None:
        return simulate_run(self.cfg, run, values, self.stop)

    def _finish(self, key: tuple, done: RunReplay, cpu_s: float) -> None:
        self._done[key] = done
        self.simulated += 1
        self.cpu_s += cpu_s
        log.info("validate: replayed %s at %s in %.2f CPU s", Path(key[0]).name, dict(key[1]), cpu_s)

    def close(self) -> None:
        """The pool's end; after a signal (`stop`), at once: its replays are dropped, not awaited."""
        if self._pool is not None:
            if self.stop():
                workers = list((getattr(self._pool, "_processes", None) or {}).values())
                self._pool.shutdown(wait=False, cancel_futures=True)
                for w in workers:
                    w.kill()
            else:
                self._pool.shutdown()
            self._pool = None


def _timed_replay(cfg: DictConfig, run: RealRun, values: dict[str, float] | None) -> tuple[RunReplay, float]:
    """A replay in a pool worker, and the worker's CPU seconds for it (what the cores must do, whatever
    else shares them)."""
    t = time.process_time()
    done = simulate_run(cfg, run, values)
    return done, time.process_time() - t


def _pool_worker(parent: int) -> None:
    """A replay worker leaves SIGINT and SIGTERM to the command (which ends it), and dies with it."""
    import signal

    from testbed.app.entry.stop import SIGNALS, die_with_parent

    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    die_with_parent(parent)


def _cost(run: RealRun) -> float:
    """A replay's relative cost: requests x output tokens (an overloaded stage's queue costs more)."""
    return sum(s.num_requests * (3 if s.overloaded else 1) for s in run.stages) * run.workload.output_len


def fit_runs(runs: list[RealRun]) -> list[RealRun]:
    """The runs a fit replays: those with a scored stage (an all-overloaded run has no residual)."""
    return [r for r in runs if not all(s.overloaded for s in r.stages)]


def residuals(replays: list[RunReplay]) -> np.ndarray:
    """Relative errors of the scored stages' FIT_METRICS, in order. A stage the simulation finished no
    request of (its figures NaN) counts as missed by 100%."""
    r = np.array([s.error(m) for rr in replays for s in scored(rr.stages) for m in FIT_METRICS], dtype=float)
    return np.nan_to_num(r, nan=1.0)


@dataclass
class FitResult:
    values: dict[str, float]
    cost: float  # sum of squared residuals at `values`
    start_cost: float
    steps: int = 0  # steps taken
    jacobians: int = 0  # finite-difference Jacobians taken
    history: list = field(default_factory=list)  # (values, cost) of every step tried


Asks = list[tuple[RealRun, dict[str, float]]]


def fit(cfg: DictConfig, replays: Replays, runs: list[RealRun], keys: list[str]) -> FitResult:
    """One fit (`fit_steps`) driven to its end."""
    return run_fits(replays, [fit_steps(cfg, runs, keys)])[0]


def run_fits(replays: Replays, fits: list[Generator[Asks, list[RunReplay], FitResult]]) -> list[FitResult]:
    """Several fits driven together: each is sent its replays as soon as they are all done and asks for
    its next ones at once (so that the workers are never left waiting on one fit's last run while another
    fit could go on), and replays asked by two fits run once. Each fit sees exactly the replays it asked
    for, whatever the order they finished in: the fitted values do not depend on the interleaving."""
    results: list[FitResult | None] = [None] * len(fits)
    waiting: dict[int, list[tuple]] = {}
    for i, f in enumerate(fits):
        waiting[i] = replays.want(next(f))  # a fit always asks for its starting point first
    while waiting:
        ready = [i for i, keys in waiting.items() if replays.ready(keys)]
        if not ready:
            replays.advance()
            continue
        for i in ready:
            got = replays.take(waiting.pop(i))
            try:
                waiting[i] = replays.want(fits[i].send(got))
            except StopIteration as done:
                results[i] = done.value
    return results  # type: ignore[return-value]


def then_replay(fit: Generator[Asks, list[RunReplay], FitResult], runs: list[RealRun]
                ) -> Generator[Asks, list[RunReplay], FitResult]:
    """`fit`, then the replays of `runs` at its values, asked as soon as it ends (its scoring, run beside
    the other fits' replays instead of after them all); the fit's result."""
    result = yield from fit
    yield [(run, result.values) for run in runs]
    return result


def fit_steps(cfg: DictConfig, runs: list[RealRun], keys: list[str]) -> Generator[Asks, list[RunReplay], FitResult]:
    """The keys (each >= 0, from the config's values) that minimise the squared relative errors of
    FIT_METRICS over the scored stages of `runs`: at most `validate.fit_iterations` steps, each from
    the bounded linear least-squares problem of the current Jacobian. A generator: it yields the
    (run, values) replays it needs and is sent them back (`run_fits`)."""
    from scipy.optimize import lsq_linear

    vc = cfg.validate
    if vc.fit_method not in FIT_METHODS:
        raise ValueError(f"validate.fit_method={vc.fit_method!r}: expected one of {', '.join(FIT_METHODS)}")
    runs = fit_runs(runs)
    x = np.array([float(OmegaConf.select(cfg, k)) for k in keys])
    scale = np.where(x > 0, x, 1e-3)  # the keys' units differ by orders: steps are solved for x / scale

    def resid(points: list[np.ndarray]):
        got = yield [(run, dict(zip(keys, p.tolist()))) for p in points for run in runs]
        return [residuals(got[i * len(runs):(i + 1) * len(runs)]) for i in range(len(points))]

    def differenced(x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The forward-difference steps at x and the points they reach, one per key."""
        # relative to the key's value, but never below a tenth of its starting scale (1e-5 for a key that
        # starts at 0): a key fitted down to ~0 would otherwise be differenced over a rounding error
        steps = vc.fit_step * np.maximum(np.abs(x), 0.1 * scale)
        return steps, [x + np.eye(len(x))[i] * steps[i] for i in range(len(x))]

    def slopes(r: np.ndarray, steps: np.ndarray, moved: list[np.ndarray]) -> np.ndarray:
        """d residuals / d (x / scale) from the residuals at the differenced points."""
        return np.column_stack([(ri - r) / steps[i] for i, ri in enumerate(moved)]) * scale

    def jacobian(x: np.ndarray, r: np.ndarray):
        """The Jacobian at x, every key's replays in one batch."""
        steps, points = differenced(x)
        return slopes(r, steps, (yield from resid(points)))

    # the first step always starts from a Jacobian at x, whose points do not depend on the residuals there:
    # asked with the start, so that no core waits for the start's slowest replay before differencing
    steps, points = differenced(x)
    r, *moved = yield from resid([x] + points)
    out = FitResult({}, float(r @ r), float(r @ r))
    jac, fresh, shrink, dz = slopes(r, steps, moved), True, 1.0, None
    out.jacobians += 1
    for i in range(vc.fit_iterations):
        last = i == vc.fit_iterations - 1
        if vc.fit_method == "newton" and not fresh:
            jac, fresh = (yield from jacobian(x, r)), True
            out.jacobians += 1
        if shrink == 1.0:
            dz = lsq_linear(jac, -r, bounds=(-x / scale, np.inf)).x
        step = dz * shrink  # a shorter step stays within the bounds (x and x + dz are)
        if np.max(np.abs(step)) < vc.fit_tolerance:
            log.info("validate: converged (no key moves by %g of its scale)", vc.fit_tolerance)
            break
        x_new = np.maximum(x + step * scale, 0.0)
        r_new, = yield from resid([x_new])
        cost, new_cost = float(r @ r), float(r_new @ r_new)
        out.history.append((dict(zip(keys, x_new.tolist())), new_cost))
        log.info("validate: step to %s: squared error %.5g -> %.5g", dict(zip(keys, x_new.round(8))), cost, new_cost)
        if new_cost < cost:
            step = (x_new - x) / scale
            jac = jac + np.outer(r_new - r - jac @ step, step) / (step @ step)  # Broyden: the secant along the step
            x, r, fresh, shrink = x_new, r_new, False, 1.0
            out.steps += 1
        elif last:  # no step is left to try from a fresh Jacobian or a shorter step: x is the fit
            break
        elif not fresh:  # the updated Jacobian misled the step: take a fresh one here and try again
            jac, fresh = (yield from jacobian(x, r)), True
            out.jacobians += 1
        elif shrink > 1 / 8:  # a fresh linearisation's step overshoots: try half of it
            shrink /= 2
        else:  # nor does an eighth of it lower the error: x is the fit
            break
    out.values, out.cost = dict(zip(keys, x.tolist())), float(r @ r)
    return out
