-- Variant runs side by side: each run's intervention, accuracy, and (token compression) the mean
-- retained ratio of image tokens, per stimulus family and regime (Go boards: ID / VE / FE; others
-- 'all'). Runs may cover different stimuli: compare rows of one family and regime.
-- param: run  a run id pattern (default '%')
SELECT r.run, coalesce(r.intervention->>'kind', 'none') AS intervention, r.intervention AS parameters,
       st.family, coalesce(st.truth->>'regime', 'all') AS regime, count(g.stimulus) AS n,
       round(avg(g.correct::INTEGER), 4) AS accuracy,
       round(avg((g.metrics->>'retained_ratio')::DOUBLE), 4) AS retained_ratio
FROM runs r
JOIN generations g USING (run)
JOIN stimuli st USING (stimulus)
WHERE r.run LIKE $run
GROUP BY ALL
ORDER BY r.run, st.family, regime;
