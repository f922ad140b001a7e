-- Do two head-ablation runs over the same stimuli rely on the same heads? (counting-bottleneck: the visual
-- and the text version of each count.) Per stimulus, each run's critical-head tensor is the
-- flip mask of every (tap, layer, head): 'equal' when the two tensors match exactly (the study's
-- Equal %; its "95.7% of heads differ" is most likely 1 - equal_share), and the Jaccard overlap
-- of the two sets of critical heads (1 when neither run has one).
-- param: a  the first run (e.g. the visual one)
-- param: b  the second run (e.g. the text one)
WITH pairs AS (
    SELECT x.stimulus, x.flip_mask AS ma, y.flip_mask AS mb, x.flipped AS fa, y.flipped AS fb
    FROM head_ablations x
    JOIN head_ablations y ON y.run = $b AND y.stimulus = x.stimulus AND y.tap = x.tap AND y.layer = x.layer
                         AND y.head = x.head
    WHERE x.run = $a
),
per_stimulus AS (
    SELECT stimulus, bool_and(ma = mb) AS equal,
           count(*) FILTER (WHERE fa AND fb) AS n_both, count(*) FILTER (WHERE fa OR fb) AS n_either,
           count(*) FILTER (WHERE fa) AS n_a, count(*) FILTER (WHERE fb) AS n_b
    FROM pairs GROUP BY stimulus
)
SELECT count(*) AS stimuli,
       round(avg(equal::INTEGER), 4) AS equal_share,
       round(1 - avg(equal::INTEGER), 4) AS unequal_share,
       round(avg(CASE WHEN n_either = 0 THEN 1.0 ELSE n_both / n_either END), 4) AS mean_jaccard,
       round(avg(n_a), 3) AS mean_critical_a,
       round(avg(n_b), 3) AS mean_critical_b
FROM per_stimulus;
