"""The farm's trainers: one :class:`probes.trainers.base.Trainer` protocol, three implementations.

- ``in_memory`` (:mod:`probes.trainers.in_memory`): a group's features read whole on one
  worker, every probe trained by its kind's ``evaluate`` (every kind's default);
- ``streamed`` (:mod:`probes.trainers.streamed`): statistics accumulated chunk by chunk in a
  Dask map-reduce per layer, solved once for every probe (``ridge`` and its kin);
- ``iterative`` (:mod:`probes.trainers.iterative`): iterative kinds out of core, on a capped,
  recorded subsample of the training units (``linear``, ``pooled``, ``conv_spatial``, ``detect``).

A kind names the trainers that may train it in ``Probe.trains``; the farm picks among them in
:mod:`probes.trainers.select`. This package imports nothing on its own: a Dask worker that
unpickles a task of one trainer imports that trainer only.
"""
