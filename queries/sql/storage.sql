-- What each run stores: arrays, committed chunks, bytes and bytes per value, per tap.
-- param: run   a run id, or '%' for every run (default '%')
SELECT run, tap, count(*) AS arrays, list(DISTINCT tokens ORDER BY tokens) AS tokens,
       sum(chunks_committed) AS chunks, sum(n_chunks) AS chunks_expected,
       sum(bytes) AS bytes, round(sum(bytes) / nullif(sum(bytes / nullif(bytes_per_value, 0)), 0), 3) AS bytes_per_value
FROM v_arrays
WHERE run LIKE $run
GROUP BY ALL
ORDER BY run, tap;
