-- Accuracy, parse rate and mean score of every run, per stimulus family.
-- A failed parse counts as wrong (the studies' denominators).
-- param: run   a run id, or '%' for every run (default '%')
SELECT g.run, st.family, count(*) AS n,
       round(avg(g.correct::INTEGER), 4) AS accuracy,
       round(avg(g.parse_ok::INTEGER), 4) AS parse_rate,
       round(avg(g.score), 4) AS mean_score
FROM generations g
JOIN stimuli st USING (stimulus)
WHERE g.run LIKE $run
GROUP BY ALL
ORDER BY g.run, st.family;
