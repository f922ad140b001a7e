-- CountingTricks: accuracy per case (1A, 2A, ..., 10A: cases in natural order, by number then
-- letter) with the count-accuracy correlation of the run (the paper reports r = -0.78 across
-- models: larger counts fail more); n_correct beside n, for an interval of the accuracy.
-- param: run   a run id, or '%' for every run (default '%')
WITH per AS (
    SELECT g.run, st.truth->>'case' AS case_id, (st.truth->>'count')::INTEGER AS count,
           coalesce(g.correct, FALSE)::INTEGER AS correct
    FROM generations g JOIN stimuli st USING (stimulus)
    WHERE st.family = 'counting' AND g.run LIKE $run
),
r AS (SELECT run, corr(count, correct) AS r FROM per GROUP BY run)
SELECT p.run, p.case_id, count(*) AS n, round(avg(p.correct), 4) AS accuracy,
       round(any_value(r.r), 4) AS count_accuracy_r, sum(p.correct) AS n_correct
FROM per p JOIN r USING (run)
GROUP BY p.run, p.case_id
ORDER BY p.run, TRY_CAST(regexp_extract(p.case_id, '^[0-9]+') AS INTEGER) NULLS LAST, p.case_id;
