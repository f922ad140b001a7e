-- Critical heads of head-ablation runs (counting-bottleneck's counting heads): per zeroed head, the share of
-- stimuli whose teacher-forced answer flips (any answer token's argmax changes), the share per
-- answer position, and the mean drop of the reference tokens' log-probability.
-- param: run  a head-ablation run, or '%' for every one (default '%')
SELECT run, tap, layer, head, count(*) AS stimuli,
       round(avg(flipped::INTEGER), 4) AS critical_share,
       round(avg(((flip_mask & 1) > 0)::INTEGER), 4) AS first_token_share,
       round(avg(((flip_mask & 2) > 0)::INTEGER), 4) AS second_token_share,
       round(avg(logit_drop), 4) AS mean_logit_drop
FROM head_ablations
WHERE run LIKE $run
GROUP BY ALL
ORDER BY run, tap, layer, head;
