-- Probe leaderboard: for every run, tap, site, token kind, target and probe kind, the best layer with
-- its score, the shuffled-label control and the selectivity (score - control), averaged over the seeds
-- of one test fraction (plans that hold out different fractions are listed apart).
-- param: run   a run id, or '%' for every run (default '%')
SELECT run, tap, site, tokens, target, kind, metric, layer AS best_layer,
       round(score, 4) AS score, round(control_score, 4) AS control, round(selectivity, 4) AS selectivity,
       n_seeds, test_fraction
FROM v_best_probe
WHERE run LIKE $run
ORDER BY run, target, tap, site, tokens, kind, test_fraction;
