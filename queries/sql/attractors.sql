-- Attractors: the wrong answers that draw far more mass than chance, per run and regime.
-- Answers are grouped by what they are (generations.answer_kind): a number (prediction), a word
-- without a digit (answer, e.g. False), empty, or runaway (no EOS within the run's cap
-- max_new_tokens; all runaway answers are one outcome, since where they were cut is the cap's doing).
-- share = the group's share of all wrong answers in the regime; lift = share x (distinct groups),
-- i.e. how many times more often than if wrong answers spread evenly over the groups seen.
-- A row is listed when share >= min_share AND lift >= min_lift: a large share alone is no
-- attractor when the wrong answers spread evenly over a few groups (four groups at 0.25 each have
-- lift 1). A regime whose wrong answers are all one group is listed whatever its lift (always 1
-- there): every wrong answer falls on it, the strongest attractor there is.
-- Kinds: numbers are 'boundary' = 49 (the vision training edge), 'text-edge' = 99, 'one-digit' =
-- 0..9, else 'other'; the rest are 'word', 'empty', 'runaway'.
-- param: run        a run id, or '%' for every run (default '%')
-- param: min_share  smallest share to list (default 0.05)
-- param: min_lift   smallest lift to list, times an even spread (default 2)
WITH wrong AS (
    SELECT g.run, coalesce(st.truth->>'regime', st.truth->>'case') AS regime, g.answer_kind,
           CASE WHEN g.answer_kind = 'digits' THEN TRY_CAST(g.prediction AS BIGINT) END AS prediction,
           CASE WHEN g.answer_kind = 'word' THEN trim(g.text) END AS answer,
           r.config->'generation'->>'max_new_tokens' AS max_new_tokens
    FROM generations g JOIN stimuli st USING (stimulus) LEFT JOIN runs r USING (run)
    WHERE st.family IN ('go', 'counting') AND g.run LIKE $run AND NOT coalesce(g.correct, FALSE)
          AND NOT ends_with(coalesce(r.config->'stimuli'->0->>'task', ''), '_tf')   -- true/false answers are no counts
),
counted AS (
    SELECT run, regime, answer_kind, prediction, answer, any_value(max_new_tokens) AS max_new_tokens,
           count(*) AS n
    FROM wrong GROUP BY run, regime, answer_kind, prediction, answer
),
shared AS (
    SELECT *, n / sum(n) OVER (PARTITION BY run, regime) AS share,
           count(*) OVER (PARTITION BY run, regime) AS distinct_values
    FROM counted
),
lifted AS (SELECT *, share * distinct_values AS lift FROM shared)
SELECT run, regime, prediction, n, round(share, 4) AS share, round(lift, 2) AS lift,
       CASE WHEN answer_kind IS DISTINCT FROM 'digits' THEN coalesce(answer_kind, 'unknown')
            WHEN prediction = 49 THEN 'boundary' WHEN prediction = 99 THEN 'text-edge'
            WHEN prediction BETWEEN 0 AND 9 THEN 'one-digit' ELSE 'other' END AS kind,
       answer, max_new_tokens
FROM lifted
WHERE share >= $min_share AND (lift >= $min_lift OR distinct_values = 1)
-- cases in natural order (1A, 2A, ..., 10A); the regimes ID, VE, FE hold no number and sort by name
ORDER BY run, TRY_CAST(regexp_extract(regime, '^[0-9]+') AS INTEGER) NULLS LAST, regime, n DESC, prediction, answer;
