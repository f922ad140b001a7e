"""Extraction on a Dask cluster of GPU workers, the client the only manifest writer.

``python -m extract MANIFEST [MANIFEST ...] --scheduler ADDRESS`` (or ``auto``, ``local``,
``inline``): the client reads the stimulus sets, asks one worker to load the model and say what
the run stores (:func:`extract.cluster.worker.plan_run`), declares the run and its arrays in the
workspace, then submits one task per chunk to workers that hold a ``GPU`` resource. A worker
keeps its model between tasks (:class:`extract.cluster.worker.ModelHolder`, a worker plugin),
writes its chunk files where the arrays live (a shared file system, or an object store from a
staging folder of its own) and returns their ``chunks`` rows; the client commits them
(:func:`extract.cluster.client.run_cluster`). Nothing on a worker takes a lock or opens DuckDB.
docs/scale.md, "Extraction on a cluster", has the recipes.
"""
