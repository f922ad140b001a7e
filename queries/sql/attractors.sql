-- Attractors: the wrong answers that draw far more mass than chance, per run and regime.
-- share = the value's share of all wrong answers in the regime; lift = share x (distinct wrong
-- values), i.e. how many times more often than if wrong answers spread evenly over the values
-- seen. Kinds: 'boundary' = 49 (the vision training edge), 'text-edge' = 99, 'one-digit' = 0..9,
-- 'empty' = no number in the answer, else 'other'.
-- param: run        a run id, or '%' for every run (default '%')
-- param: min_share  smallest share to list (default 0.05)
WITH wrong AS (
    SELECT g.run, coalesce(st.truth->>'regime', st.truth->>'case') AS regime, g.prediction::INTEGER AS prediction
    FROM generations g JOIN stimuli st USING (stimulus)
    WHERE st.family IN ('go', 'counting') AND g.run LIKE $run AND NOT coalesce(g.correct, FALSE)
),
counted AS (
    SELECT run, regime, prediction, count(*) AS n FROM wrong GROUP BY ALL
),
shared AS (
    SELECT *, n / sum(n) OVER (PARTITION BY run, regime) AS share,
           count(*) OVER (PARTITION BY run, regime) AS distinct_values
    FROM counted
)
SELECT run, regime, prediction, n, round(share, 4) AS share, round(share * distinct_values, 2) AS lift,
       CASE WHEN prediction IS NULL THEN 'empty' WHEN prediction = 49 THEN 'boundary'
            WHEN prediction = 99 THEN 'text-edge' WHEN prediction BETWEEN 0 AND 9 THEN 'one-digit'
            ELSE 'other' END AS kind
FROM shared
WHERE share >= $min_share
ORDER BY run, regime, n DESC, prediction;
