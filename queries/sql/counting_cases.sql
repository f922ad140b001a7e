-- CountingTricks: accuracy per case (1A..15A) with the count-accuracy correlation of the run
-- (the paper reports r = -0.78 across models: larger counts fail more).
-- param: run   a run id, or '%' for every run (default '%')
WITH per AS (
    SELECT g.run, st.truth->>'case' AS case_id, (st.truth->>'count')::INTEGER AS count,
           coalesce(g.correct, FALSE)::INTEGER AS correct
    FROM generations g JOIN stimuli st USING (stimulus)
    WHERE st.family = 'counting' AND g.run LIKE $run
),
r AS (SELECT run, corr(count, correct) AS r FROM per GROUP BY run)
SELECT p.run, p.case_id, count(*) AS n, round(avg(p.correct), 4) AS accuracy,
       round(any_value(r.r), 4) AS count_accuracy_r
FROM per p JOIN r USING (run)
GROUP BY p.run, p.case_id
ORDER BY p.run, p.case_id;
